"""Batched decode (ragkv.model.batch) against one-request-at-a-time decode: same greedy tokens."""

from __future__ import annotations

import torch

from ragkv.generation import GenerationConfig, decode_loop
from ragkv.model.batch import DecodeBatch


def _prompts(adapter, n: int) -> list[list[int]]:
    texts = [f"Request {i}: " + "lorem ipsum dolor " * (i + 1) + "sit amet" for i in range(n)]
    return [adapter.encode(t) for t in texts]


def _alone(adapter, ids: list[int], steps: int) -> list[int]:
    cache = adapter.build_cache([])
    logits = adapter.forward(ids, cache, 0)[-1]
    return list(decode_loop(adapter, cache, logits, len(ids), GenerationConfig(max_new_tokens=steps)))


def _prefilled(adapter, ids: list[int]) -> tuple[object, int]:
    cache = adapter.build_cache([])
    logits = adapter.forward(ids, cache, 0)[-1]
    return cache, int(torch.argmax(logits))


def test_batched_greedy_equals_alone_with_rows_joining_and_leaving(tiny_adapter):
    adapter = tiny_adapter
    eos = adapter.eos_token_ids
    prompts = _prompts(adapter, 5)
    steps = 12
    want = [_alone(adapter, p, steps) for p in prompts]
    batch = DecodeBatch(adapter)
    got: dict[int, list[int]] = {}
    last: dict[int, int] = {}
    # request i joins at step 2*i; request 1 leaves early (after 5 tokens), the others at `steps`
    limits = {i: (5 if i == 1 else steps) for i in range(len(prompts))}
    with torch.inference_mode():
        for t in range(2 * len(prompts) + steps + 2):
            if t % 2 == 0 and t // 2 < len(prompts):
                i = t // 2
                cache, tok = _prefilled(adapter, prompts[i])
                got[i], last[i] = [tok], tok
                batch.add(str(i), cache, len(prompts[i]))
            for key in list(batch.keys):
                i = int(key)
                if len(got[i]) >= limits[i] or got[i][-1] in eos:
                    batch.remove(key)
            if not len(batch):
                continue
            logits = batch.step([last[int(k)] for k in batch.keys])
            for row, key in enumerate(batch.keys):
                tok = int(torch.argmax(logits[row]))
                got[int(key)].append(tok)
                last[int(key)] = tok
    for i, p in enumerate(prompts):
        alone = want[i][: limits[i]]
        mine = got[i][: limits[i]]
        if any(x in eos for x in mine):
            mine = mine[: next(j for j, x in enumerate(mine) if x in eos)]
        assert mine[: len(alone)] == alone, f"request {i} ({len(p)} prompt tokens)"


def test_the_buffers_grow_past_their_spare_columns(llama_adapter):
    adapter = llama_adapter
    ids = adapter.encode("a short prompt")
    steps = 80  # past the 64 spare columns of the first pack
    with torch.inference_mode():
        want = _alone(adapter, ids, steps)
        cache, tok = _prefilled(adapter, ids)
        batch = DecodeBatch(adapter)
        batch.add("a", cache, len(ids))
        got = [tok]
        while len(got) < len(want):
            got.append(int(torch.argmax(batch.step([got[-1]])[0])))
    assert got == want


def test_joining_and_leaving_moves_no_other_row(llama_adapter):
    """Rows live in their own slots: a join copies only its prompt, a leave copies nothing, and a freed
    slot in the middle is reused while the rows after it keep decoding exactly."""
    adapter = llama_adapter
    prompts = _prompts(adapter, 4)
    steps = 6
    want = [_alone(adapter, p, steps) for p in prompts]
    batch = DecodeBatch(adapter)
    got: dict[str, list[int]] = {}
    with torch.inference_mode():
        for i in range(3):
            cache, tok = _prefilled(adapter, prompts[i])
            batch.add(str(i), cache, len(prompts[i]), reserve=64)
            got[str(i)] = [tok]
        buffers = batch._layers[0].keys.data_ptr()
        row2 = batch._layers[0].keys[2].clone()
        batch.remove("1")  # a hole at slot 1: slots 0 and 2 stay where they are
        assert batch.keys == ["0", "2"] and batch._layers[0].keys.data_ptr() == buffers
        assert torch.equal(batch._layers[0].keys[2], row2)
        for _ in range(2):
            logits = batch.step([got[k][-1] for k in batch.keys])
            for row, key in enumerate(batch.keys):
                got[key].append(int(torch.argmax(logits[row])))
        cache, tok = _prefilled(adapter, prompts[3])
        batch.add("3", cache, len(prompts[3]), reserve=64)  # takes the free slot 1
        got["3"] = [tok]
        assert batch.keys == ["0", "3", "2"] and batch._layers[0].keys.data_ptr() == buffers
        while any(len(got[k]) < steps for k in batch.keys):
            logits = batch.step([got[k][-1] for k in batch.keys])
            for row, key in enumerate(batch.keys):
                got[key].append(int(torch.argmax(logits[row])))
        assert batch._layers[0].keys.data_ptr() == buffers  # the reservation held: no step grew the buffers
    for i in (0, 2, 3):
        assert got[str(i)][:steps] == want[i], f"request {i}"
    batch.remove("0"), batch.remove("2"), batch.remove("3")
    assert len(batch) == 0 and batch.capacity == 0  # an empty batch holds no buffers
