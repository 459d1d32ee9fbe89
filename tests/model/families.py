"""The family matrix: tiny random-weight configs of every decoder family a user might bring.

Each entry: (id, model_type, config overrides, expected) where expected is "exact" or a regex the
UnsupportedModelError message must match (the named reason).
"""

from __future__ import annotations

from typing import Any

_LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 512,
    "rope_theta": 10000.0,
}
_LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0 + 0.1 * i for i in range(8)],
    "long_factor": [2.0 + 0.5 * i for i in range(8)],
    "original_max_position_embeddings": 256,
    "rope_theta": 10000.0,
}
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
_WINDOW = {"sliding_window": 100}
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "rope_theta": 10000.0}
_MLA = {
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
}

# (id, model_type, overrides, expected): "exact", or a regex naming the refusal's reason
FAMILIES: list[tuple[str, str, dict[str, Any], str]] = [
    ("llama", "llama", {}, "exact"),
    ("llama-llama3", "llama", {"rope_parameters": _LLAMA3}, "exact"),
    ("llama-yarn", "llama", {"rope_parameters": _YARN}, "exact"),
    (
        "llama-linear",
        "llama",
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
        "exact",
    ),
    (
        "llama-dynamic",
        "llama",
        {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
        "exact",
    ),
    ("llama-longrope", "llama", {"rope_parameters": _LONGROPE}, "exact"),
    ("qwen2", "qwen2", {}, "exact"),
    (
        "qwen2-window-layers",
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 100, "max_window_layers": 1},
        "exact",
    ),
    ("qwen2_moe", "qwen2_moe", {**_MOE, "shared_expert_intermediate_size": 32}, "exact"),
    ("qwen3", "qwen3", {}, "exact"),
    ("qwen3_moe", "qwen3_moe", _MOE, "exact"),
    ("mistral", "mistral", {"sliding_window": None}, "exact"),
    ("mistral-window", "mistral", _WINDOW, "exact"),
    ("mixtral", "mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}, "exact"),
    ("phi3", "phi3", {}, "exact"),
    ("phi3-window", "phi3", _WINDOW, "exact"),
    ("phi3-longrope", "phi3", {"rope_parameters": _LONGROPE, "original_max_position_embeddings": 256}, "exact"),
    ("olmo2", "olmo2", {}, "exact"),
    ("stablelm", "stablelm", {"partial_rotary_factor": 0.25}, "exact"),
    ("starcoder2", "starcoder2", _WINDOW, "exact"),
    ("glm4", "glm4", {}, "exact"),
    ("glm", "glm", {}, "exact"),
    ("ernie4_5", "ernie4_5", {}, "exact"),
    ("helium", "helium", {}, "exact"),
    ("smollm3", "smollm3", {"no_rope_layers": [0, 1, 1, 0]}, "exact"),
    ("granite", "granite", {"embedding_multiplier": 12.0}, "embedding_multiplier"),
    ("gemma", "gemma", {}, "gemma|embedding"),
    ("gemma2", "gemma2", {"attn_implementation": "eager"}, "softcapping|sliding|gemma"),
    ("gemma3", "gemma3_text", {}, "gemma|sliding"),
    ("cohere", "cohere", {}, "logit_scale"),
    ("gpt2", "gpt2", {}, "rotary_emb|embed_tokens"),
    ("deepseek_v2", "deepseek_v2", _MLA, "latent|per-head"),
    ("deepseek_v3", "deepseek_v3", {**_MLA, "n_group": 1, "topk_group": 1}, "latent|per-head"),
]
