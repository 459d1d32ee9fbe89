"""Which SDPA kernel torch picks for the recompute's masked attention on this device, with the key
and value heads shared (``enable_gqa``) and repeated to the query heads.

    python experiments/gpu_sdpa_choice.py

``ragkv.model.attention._shares_heads`` shares them where torch picks a fused kernel for the shared
call; the math kernel (which makes every head's scores whole) keeps the repeat. This prints torch's
choice for a block of the recompute at 16K tokens of Llama-3.1-8B's shape (32 query heads over 8 KV
heads, head dim 128, bf16, 2,400 rows over 16,000 slots), and times both calls when both are fused.
On a CPU it prints the CPU's choice.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from transformers.integrations.sdpa_attention import repeat_kv


def main() -> None:
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    rows, slots = (2400, 16000) if cuda else (240, 1600)
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, 32, rows, 128, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, 8, slots, 128, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, 8, slots, 128, device=dev, dtype=torch.bfloat16, generator=g)
    pos = torch.linspace(slots // 8, slots - 1, rows, device=dev).long()
    mask = torch.zeros(1, 1, rows, slots, device=dev, dtype=torch.bfloat16)
    mask.masked_fill_(torch.arange(slots, device=dev) > pos[:, None], torch.finfo(torch.bfloat16).min)
    kr, vr = repeat_kv(k, 4), repeat_kv(v, 4)
    shared = SDPBackend(torch._fused_sdp_choice(q, k, v, mask, 0.0, False, scale=None, enable_gqa=True))
    apart = SDPBackend(torch._fused_sdp_choice(q, kr, vr, mask, 0.0, False, scale=None, enable_gqa=False))
    print(f"{torch.cuda.get_device_name() if cuda else 'cpu'}, torch {torch.__version__}: {rows} rows x {slots} slots")
    print(f"  shared heads (enable_gqa): {shared.name}; repeated: {apart.name}")
    if SDPBackend.MATH in (shared, apart) and cuda:
        return  # the math kernel would take GiBs here: not timed

    def timed(fn: object) -> float:
        best = float("inf")
        for _ in range(5):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()  # type: ignore[operator]
            if cuda:
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return best * 1e3

    a = timed(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))
    b = timed(lambda: F.scaled_dot_product_attention(q, repeat_kv(k, 4), repeat_kv(v, 4), attn_mask=mask))
    c = timed(lambda: F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask))
    print(f"  ms, best of 5: shared {a:.2f}; repeat + call {b:.2f}; call on repeated {c:.2f}")


if __name__ == "__main__":
    main()
