"""Chunked prefill (RagKV.prefill_steps, fusion.fuse_steps) against the one-shot prefill: same logits and tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ragkv.engine import EngineConfig, RagKV
from ragkv.fusion import PieceBudget, drain
from ragkv.generation import GenerationConfig, decode_loop
from ragkv.model.batch import DecodeBatch
from ragkv.retriever.chunker import ChunkerConfig
from ragkv.retriever.documents import Document
from ragkv.retriever.embedder import HashingEmbedder
from ragkv.retriever.kv_retriever import RetrieverConfig

DOCS = [
    Document("mem:apples", "Apples grow on trees in orchards. " * 12 + "\n\nThey are red or green. " * 8, "apples"),
    Document("mem:boats", "Boats float on water and carry people. " * 10 + "\n\nSails catch the wind. " * 9, "boats"),
]
PROMPT = ["You answer briefly. " * 6 + "Question: what do boats carry, and where do apples grow? Answer:"]


def _engine(tmp_path: Path, adapter) -> RagKV:
    cfg = EngineConfig(
        data_dir=tmp_path,
        retriever=RetrieverConfig(top_k=2, chunker=ChunkerConfig(min_tokens=40, max_tokens=120)),
        store=("memory://", str(tmp_path / "kv")),
    )
    return RagKV(cfg, adapter=adapter, embedder=HashingEmbedder(dim=64))


def _pieces(steps) -> tuple[object, int]:
    """Drain ``steps``, counting the pauses; return (result, pieces)."""
    n = 1
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value, n
        n += 1


def _greedy(adapter, pre, n: int = 8) -> list[int]:
    return list(decode_loop(adapter, pre.cache, pre.logits, pre.num_tokens, GenerationConfig(max_new_tokens=n)))


def _kv(pre) -> torch.Tensor:
    return torch.stack([layer.keys[0, :, : pre.num_tokens] for layer in pre.cache.layers])


def test_a_full_prefill_in_chunks_equals_the_one_shot_prefill(tmp_path, llama_adapter):
    with _engine(tmp_path, llama_adapter) as rag, torch.inference_mode():
        n = len(rag.adapter.encode(PROMPT[0]))
        whole = rag.prefill(PROMPT, mode="full")
        chunked, pieces = _pieces(rag.prefill_steps(PROMPT, mode="full", step_tokens=7))
        assert pieces == -(-n // 7) and chunked.stats.extra["prefill_pieces"] == pieces
        assert chunked.num_tokens == whole.num_tokens == n
        torch.testing.assert_close(chunked.logits, whole.logits, atol=1e-4, rtol=1e-4)  # fp32 rounding only
        torch.testing.assert_close(_kv(chunked), _kv(whole), atol=1e-4, rtol=1e-4)
        assert _greedy(rag.adapter, chunked) == _greedy(rag.adapter, whole)


def test_a_fused_prefill_in_pieces_is_exactly_the_one_shot_fusion(tmp_path, llama_adapter):
    with _engine(tmp_path, llama_adapter) as rag, torch.inference_mode():
        rag.index(DOCS, progress=False)
        texts = [c.text for c in rag.retrieve("boats and apples")]
        rag_prompt = (texts, "What do boats carry?")
        whole = rag.prefill(rag=rag_prompt)
        pieced, pieces = _pieces(rag.prefill_steps(rag=rag_prompt, step_tokens=2))
        # the recompute pass paused between layers; the same operations ran in the same order
        assert pieces > 2
        assert torch.equal(pieced.logits, whole.logits) and torch.equal(_kv(pieced), _kv(whole))
        assert pieced.stats.recomputed_tokens == whole.stats.recomputed_tokens
        assert _greedy(rag.adapter, pieced) == _greedy(rag.adapter, whole)


def test_decode_steps_between_the_pieces_change_nothing(tmp_path, llama_adapter):
    """The server's pattern: one piece, one decode step of the running rows, and so on."""
    with _engine(tmp_path, llama_adapter) as rag, torch.inference_mode():
        rag.index(DOCS, progress=False)
        texts = [c.text for c in rag.retrieve("apples")]
        running = rag.prefill(PROMPT, mode="full")
        batch = DecodeBatch(rag.adapter)
        batch.add("running", running.cache, running.num_tokens, reserve=64)
        token, fed = int(torch.argmax(running.logits)), []
        for mode, step_tokens in (("full", 5), ("reuse", 2)):
            kw = {"rag": (texts, "Where do apples grow?"), "mode": mode}
            whole = rag.prefill(**kw)
            steps = rag.prefill_steps(**kw, step_tokens=step_tokens)
            while True:
                try:
                    next(steps)
                except StopIteration as done:
                    pieced = done.value
                    break
                fed.append(token)
                token = int(torch.argmax(batch.step([token])[0]))
            torch.testing.assert_close(pieced.logits, whole.logits, atol=1e-4, rtol=1e-4)
        alone = _greedy(rag.adapter, rag.prefill(PROMPT, mode="full"), n=len(fed) + 1)
        assert fed + [token] == alone[: len(fed) + 1]  # and the running row decoded exactly as alone


def test_bad_step_tokens_are_refused(tmp_path, llama_adapter):
    with _engine(tmp_path, llama_adapter) as rag, pytest.raises(ValueError, match="step_tokens"):
        drain(rag.prefill_steps(PROMPT, step_tokens=0))


def test_a_piece_gives_the_rows_riding_on_it_their_share_of_the_budget_but_at_most_half(tmp_path, llama_adapter):
    """The first piece carries a 3-row step: with 8 tokens a piece it runs 5 prompt tokens; with 4, 2 (not 1)."""
    from ragkv.model.batch import Rider

    with _engine(tmp_path, llama_adapter) as rag, torch.inference_mode():
        a = rag.adapter
        n = len(a.encode(PROMPT[0]))
        whole = rag.prefill(PROMPT, mode="full")
        for budget, first in ((8, 5), (4, 2)):
            batch = DecodeBatch(a)
            for i in range(3):
                cache = a.build_cache([])
                a.forward(a.encode(f"Row {i} says hello"), cache, 0, logits="none")
                batch.add(str(i), cache, 5, reserve=4)
            assert batch.step_rows == 3
            rider = Rider(batch, [1, 2, 3])
            pre, pieces = _pieces(rag.prefill_steps(PROMPT, mode="full", step_tokens=budget, riders=lambda: rider))  # noqa: B023
            assert rider.logits is not None  # the first pass carried the step
            assert pieces == 1 + -(-(n - first) // budget)  # a step is carried once: later pieces take whole budgets
            torch.testing.assert_close(pre.logits, whole.logits, atol=1e-4, rtol=1e-4)


def test_a_carried_step_that_fails_leaves_the_rows_where_they_were(tmp_path, llama_adapter, monkeypatch):
    """A pass that raises after the layers (at the LM head) has not advanced the rows: the next step is exact."""
    a = llama_adapter
    with torch.inference_mode():
        batches = []
        for _ in range(2):
            batch = DecodeBatch(a)
            for i in range(2):
                cache = a.build_cache([])
                a.forward(a.encode(f"Row {i} says hello"), cache, 0, logits="none")
                batch.add(str(i), cache, 5, reserve=4)
            batches.append(batch)
        failing, clean = batches
        before = list(failing._length)
        with monkeypatch.context() as m:
            m.setattr(a, "final_logits", lambda hidden: (_ for _ in ()).throw(MemoryError("out of memory")))
            with pytest.raises(MemoryError):
                failing.carried_step([7, 8], torch.tensor(a.encode("piece")), a.build_cache([]), 0, "none")
        assert failing._length == before
        torch.testing.assert_close(failing.step([7, 8]), clean.step([7, 8]), atol=1e-5, rtol=1e-5)


def test_no_step_rides_once_the_models_attention_was_switched_away_from_ragkvs_dispatcher(tmp_path, llama_adapter):
    a = llama_adapter
    batch = DecodeBatch(a)
    cache = a.build_cache([])
    with torch.inference_mode():
        a.forward(a.encode("Row says hello"), cache, 0, logits="none")
    batch.add("0", cache, 5, reserve=4)
    assert batch.can_carry()
    cfg = a.model.config
    name = cfg._attn_implementation
    try:
        cfg._attn_implementation = name.removeprefix("ragkv_")
        assert not batch.can_carry()  # the pass's attention could not be split
    finally:
        cfg._attn_implementation = name


class _Sizes(PieceBudget):
    """Piece sizes from a list, then None (the rest in one piece); records the work each piece reports."""

    def __init__(self, sizes: list[int]) -> None:
        super().__init__(None)
        self.sizes, self.reports = list(sizes), []

    def tokens(self) -> int | None:
        return self.sizes.pop(0) if self.sizes else None

    def spent(self, tokens: float, seconds: float) -> None:
        assert seconds > 0
        self.reports.append(tokens)


def test_a_budget_sizes_each_full_prefill_piece_as_it_comes_and_hears_each(tmp_path, llama_adapter):
    with _engine(tmp_path, llama_adapter) as rag, torch.inference_mode():
        n = len(rag.adapter.encode(PROMPT[0]))
        whole = rag.prefill(PROMPT, mode="full")
        budget = _Sizes([3, 9, 4])
        pieced, pieces = _pieces(rag.prefill_steps(PROMPT, mode="full", step_tokens=budget))
        assert pieces == 4 and budget.reports == [3, 9, 4, n - 16]  # then no limit: the rest at once
        torch.testing.assert_close(pieced.logits, whole.logits, atol=1e-4, rtol=1e-4)
        assert _greedy(rag.adapter, pieced) == _greedy(rag.adapter, whole)


def test_a_budget_sizes_each_fused_piece_as_it_comes_and_the_fusion_is_exact(tmp_path, llama_adapter):
    with _engine(tmp_path, llama_adapter) as rag, torch.inference_mode():
        rag.index(DOCS, progress=False)
        rag_prompt = ([c.text for c in rag.retrieve("boats and apples")], "What do boats carry?")
        whole = rag.prefill(rag=rag_prompt)
        layers = rag.adapter.spec.num_layers
        for sizes, reports in (([1, 1, 1], 4), ([1, 10_000], 2), ([], 1)):  # a size of 1 pauses after a layer
            budget = _Sizes(sizes)
            pieced, pieces = _pieces(rag.prefill_steps(rag=rag_prompt, step_tokens=budget))
            assert torch.equal(pieced.logits, whole.logits) and torch.equal(_kv(pieced), _kv(whole))
            # the load and the probe are pieces of their own; each recompute piece reported its work, and
            # the work of all of them is the pass's (every layer ran the recomputed tokens and the suffix)
            assert pieces == 2 + len(budget.reports) and len(budget.reports) == reports
            passes = sum(budget.reports) * layers
            assert passes >= (whole.stats.recomputed_tokens + 1) * layers


def test_a_step_that_is_not_a_size_or_a_budget_is_refused(tmp_path, llama_adapter):
    with _engine(tmp_path, llama_adapter) as rag:
        for bad in (0, -3, 2.5, True, "64"):
            with pytest.raises(ValueError, match="step_tokens must be an int >= 1, a PieceBudget or None"):
                drain(rag.prefill_steps(PROMPT, step_tokens=bad))


class _Clocked(PieceBudget):
    """A budget with a time: each piece of a fused pass's layer loops ends when the next layer would pass it."""

    def __init__(self, seconds: float) -> None:
        super().__init__(None)
        self.piece_s = seconds

    def seconds(self) -> float | None:
        return self.piece_s


def test_a_budget_with_a_time_cuts_the_probe_and_the_recompute_by_the_clock_and_changes_nothing(
    tmp_path, llama_adapter
):
    """A time no layer fits in: every layer of the probe and of the recompute pass is a piece of its own; a
    time every pass fits in: the load, the probe and the recompute are one piece each. The same tensors."""
    with _engine(tmp_path, llama_adapter) as rag, torch.inference_mode():
        rag.index(DOCS, progress=False)
        rag_prompt = ([c.text for c in rag.retrieve("boats and apples")], "What do boats carry?")
        whole = rag.prefill(rag=rag_prompt)
        layers = rag.adapter.spec.num_layers
        for seconds, expected in ((1e-9, 1 + 2 * layers), (1e9, 3)):
            pieced, pieces = _pieces(rag.prefill_steps(rag=rag_prompt, step_tokens=_Clocked(seconds)))
            assert pieces == expected
            assert torch.equal(pieced.logits, whole.logits) and torch.equal(_kv(pieced), _kv(whole))
