"""How much error does the int8 decode copy add, next to the error the GGUF file already carries?

Issue 37, item 5: make the int8 decode copy the default for a quantized GGUF file if its error is
the smaller by far. The file's own error (its weights against the model it was quantized from) cannot
be measured here: the original weights are not on this machine. It is estimated instead from the
file itself: each decoder matrix gets one more rounding of its own kind, noise drawn uniformly over
half a grid step, the step read from each block of the de-quantized weights (Q4_K: 16 levels per 32
values, Q5_0: 32, Q6_K: 64 per 16, Q8_0: 255 per 32). A rounding to the same grid costs about what
the file's rounding cost (errors of a uniform quantizer are close to uniform and independent).

Both perturbations touch the same tensors (the decoder's linear layers and the LM head, what the
int8 copy quantizes). For each QA prompt of the shipped set, the file's model answers greedily; each
variant is then fed the same prompt and answer (teacher forcing), and we report the mean KL of the
answer tokens' distributions against the file's model, and how often the top token agrees. The int8
copy decodes the answer over the prompt's cache as the model prefilled it (as ragkv runs it); the
rounded twin runs the whole sequence (the file's error is in every pass).

    python experiments/decode_weight_error.py --model $(../shared/models/fetch-model.sh qwen2.5-0.5b) \
        --prompts 12 --json docs/decode_weight_error_q05.json
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import re
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from ragkv.bench.qa_data import build_prompt, load_qa_set
from ragkv.model import load_model
from ragkv.model.gguf_header import read_tensor_types
from ragkv.model.quant import quantized

logger = logging.getLogger("decode_weight_error")

# ggml type -> (values per block, levels, symmetric)
GRIDS = {
    "Q4_0": (32, 16, True),
    "Q4_1": (32, 16, False),
    "Q5_0": (32, 32, True),
    "Q5_1": (32, 32, False),
    "Q8_0": (32, 255, True),
    "Q4_K": (32, 16, False),
    "Q5_K": (32, 32, False),
    "Q6_K": (16, 64, True),
}
# GGUF tensor name -> transformers parameter name (Llama/Qwen2 layout)
_PARTS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(gguf: str) -> str | None:
    if gguf == "output.weight":
        return "lm_head.weight"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf)
    if m and m.group(2) in _PARTS:
        return f"model.layers.{m.group(1)}.{_PARTS[m.group(2)]}.weight"
    return None


def one_more_rounding(weight: torch.Tensor, kind: str, gen: torch.Generator) -> torch.Tensor:
    """``weight`` plus uniform noise of half its own grid step, per block along the input dimension."""
    block, levels, symmetric = GRIDS[kind]
    out, cols = weight.shape
    w = weight.float().reshape(out, cols // block, block)
    if symmetric:
        step = w.abs().amax(-1, keepdim=True) * 2 / (levels - 1)
    else:
        step = (w.amax(-1, keepdim=True) - w.amin(-1, keepdim=True)) / (levels - 1)
    noise = (torch.rand(w.shape, generator=gen) - 0.5) * step
    return (w + noise).reshape(out, cols).to(weight.dtype)


def rounded_copy(model: Any, types: dict[str, tuple[str, tuple[int, ...]]], seed: int) -> tuple[Any, dict[str, int]]:
    """A copy of ``model`` whose linear layers and LM head carry one more rounding of their file type."""
    twin = copy.deepcopy(model)
    params = dict(twin.named_parameters())
    gen = torch.Generator().manual_seed(seed)
    counts: dict[str, int] = {}
    with torch.no_grad():
        for name, (kind, _) in types.items():
            target = hf_name(name)
            if target is None or kind not in GRIDS:
                continue
            if target not in params:  # tied embeddings: lm_head is the embedding
                target = "model.embed_tokens.weight" if name == "output.weight" else target
            p = params[target]
            p.copy_(one_more_rounding(p, kind, gen))
            counts[kind] = counts.get(kind, 0) + 1
    return twin, counts


def answer_kl(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """Mean KL(ref || got) over positions, and the share of positions whose top token agrees."""
    lr, lg = ref.float().log_softmax(-1), got.float().log_softmax(-1)
    kl = (lr.exp() * (lr - lg)).sum(-1)
    return float(kl.mean()), float((ref.argmax(-1) == got.argmax(-1)).float().mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a GGUF file")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--answer-tokens", type=int, default=48)
    ap.add_argument("--seeds", type=int, default=2, help="draws of the simulated rounding")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    adapter = load_model(args.model, dtype="float32")
    model, tok = adapter.model, adapter.tokenizer
    types = read_tensor_types(args.model)
    qa = load_qa_set()
    count = lambda text: len(tok(text, add_special_tokens=False).input_ids)  # noqa: E731
    int8 = quantized(model, "int8")
    twins = [rounded_copy(model, types, seed) for seed in range(args.seeds)]
    rows = []
    t0 = time.perf_counter()
    for q in qa.questions[: args.prompts]:
        p = build_prompt(qa, q, count)
        user = "\n\n".join(p["chunks"]) + "\n\nQuestion: " + p["question"]
        messages = [{"role": "system", "content": p["system"]}, {"role": "user", "content": user}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        ids = ids["input_ids"]
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=args.answer_tokens, do_sample=False)
            n = ids.shape[1]
            # the logits that predicted the answer's tokens after its first (the first comes from the
            # prefill, which reads the model's weights in ragkv whatever the decode weights)
            span = slice(n, out.shape[1] - 1)
            ref = model(out).logits[0, span]
            row = {"question": q.id, "prompt_tokens": n, "answer_tokens": out.shape[1] - n}
            past = model(out[:, :n], use_cache=True).past_key_values  # the prompt, prefilled by the model
            row["int8_kl"], row["int8_top1"] = answer_kl(ref, int8(out[:, span], past_key_values=past).logits[0])
            draws = [answer_kl(ref, twin(out).logits[0, span]) for twin, _ in twins]
            row["file_kl"] = statistics.mean(d[0] for d in draws)
            row["file_top1"] = statistics.mean(d[1] for d in draws)
        rows.append(row)
        logger.info("%s: int8 KL %.4f, one more file rounding KL %.4f", q.id, row["int8_kl"], row["file_kl"])
    summary = {
        "model": Path(args.model).name,
        "tensor_types": twins[0][1],
        "prompts": len(rows),
        "int8_kl_mean": statistics.mean(r["int8_kl"] for r in rows),
        "file_kl_mean": statistics.mean(r["file_kl"] for r in rows),
        "int8_top1": statistics.mean(r["int8_top1"] for r in rows),
        "file_top1": statistics.mean(r["file_top1"] for r in rows),
        "seconds": time.perf_counter() - t0,
    }
    summary["ratio"] = summary["file_kl_mean"] / max(summary["int8_kl_mean"], 1e-12)
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
