"""Batched decode (ragkv.model.batch) against one-request-at-a-time decode: same greedy tokens."""

from __future__ import annotations

import pytest
import torch

from ragkv.generation import GenerationConfig, decode_loop
from ragkv.model import AttentionProbe, Steer
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


def _rows(adapter, prompts: list[list[int]], free_slot: bool) -> tuple[DecodeBatch, list[int]]:
    """A batch of ``prompts`` (the second's slot freed again when ``free_slot``) and each row's next token."""
    batch = DecodeBatch(adapter)
    tokens = []
    for i, ids in enumerate(prompts):
        cache, tok = _prefilled(adapter, ids)
        batch.add(str(i), cache, len(ids), reserve=8)
        tokens.append(tok)
    if free_slot:
        batch.remove("1")
        del tokens[1]
    return batch, tokens


def test_a_carried_step_equals_a_piece_then_a_step_of_its_own(llama_adapter):
    """The slow path: the piece's own forward pass, then the batch's own step. The carried step computes both."""
    adapter = llama_adapter
    prompts = _prompts(adapter, 3)
    piece_ids = adapter.encode("Background notes follow. " + "The orchard keeps many apple trees. " * 6)
    head, tail = piece_ids[:9], piece_ids[9:]  # the piece runs on top of an earlier piece's cache
    with torch.inference_mode():
        for free_slot in (False, True):  # a freed slot between live rows decodes a dummy token
            for logits in ("last", "all", "none"):
                slow_batch, tokens = _rows(adapter, prompts, free_slot)
                slow_cache = adapter.build_cache([])
                adapter.forward(head, slow_cache, 0, logits="none")
                want_piece = adapter.forward(tail, slow_cache, len(head), logits=logits)
                want_rows = slow_batch.step(tokens)

                fast_batch, _ = _rows(adapter, prompts, free_slot)
                fast_cache = adapter.build_cache([])
                adapter.forward(head, fast_cache, 0, logits="none")
                assert fast_batch.can_carry()
                got_piece, got_rows = fast_batch.carried_step(tokens, torch.tensor(tail), fast_cache, len(head), logits)
                assert got_piece.shape == want_piece.shape and got_rows.shape == want_rows.shape
                torch.testing.assert_close(got_piece, want_piece, atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(got_rows, want_rows, atol=1e-4, rtol=1e-4)
                for slow, fast in zip(slow_cache.layers, fast_cache.layers, strict=True):
                    torch.testing.assert_close(fast.keys, slow.keys, atol=1e-5, rtol=1e-5)
                    torch.testing.assert_close(fast.values, slow.values, atol=1e-5, rtol=1e-5)
                for slow, fast in zip(slow_batch._layers, fast_batch._layers, strict=True):
                    torch.testing.assert_close(fast.keys, slow.keys, atol=1e-5, rtol=1e-5)
                    torch.testing.assert_close(fast.values, slow.values, atol=1e-5, rtol=1e-5)
                # both batches go on identically: the rows' next steps agree
                nxt = [int(t) for t in torch.argmax(want_rows, dim=-1)]
                torch.testing.assert_close(fast_batch.step(nxt), slow_batch.step(nxt), atol=1e-4, rtol=1e-4)


def test_a_rider_is_carried_by_the_forward_pass_it_is_handed_to(llama_adapter):
    from ragkv.model.batch import Rider

    adapter = llama_adapter
    prompts = _prompts(adapter, 2)
    with torch.inference_mode():
        batch, tokens = _rows(adapter, prompts, free_slot=False)
        want_batch, _ = _rows(adapter, prompts, free_slot=False)
        want = want_batch.step(tokens)
        ids = adapter.encode("Some words of a prompt to prefill")
        cache = adapter.build_cache([])
        rider = Rider(batch, tokens)
        adapter.forward(ids[:4], cache, 0, logits="none", rider=rider)
        assert rider.logits is not None
        adapter.forward(ids[4:], cache, 4, logits="last")  # a pass handed no rider carries nothing
        torch.testing.assert_close(rider.logits, want, atol=1e-4, rtol=1e-4)
        assert batch._length == want_batch._length
        with pytest.raises(ValueError, match="plain pass"):  # a probed pass records its own queries only
            adapter.forward(ids[4:], cache, 4, steer=Steer(probe=AttentionProbe(None)), rider=Rider(batch, tokens))


def test_int8_steps_are_not_carried(llama_adapter):
    batch = DecodeBatch(llama_adapter, weights="int8")
    cache, _ = _prefilled(llama_adapter, _prompts(llama_adapter, 1)[0])
    batch.add("0", cache, 5)
    assert not batch.can_carry()  # its steps read other weights than a prefill piece
    assert not DecodeBatch(llama_adapter).can_carry()  # nothing to carry


def test_a_step_runs_every_slot_up_to_the_last_live_one_free_slots_included(llama_adapter):
    """A piece's budget counts ``step_rows`` (AnswerPath._full_steps): a freed slot between live rows still runs."""
    with torch.inference_mode():
        batch, _ = _rows(llama_adapter, _prompts(llama_adapter, 3), free_slot=True)
    assert len(batch) == 2 and batch.step_rows == 3
