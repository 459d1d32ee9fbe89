"""Issue 32: every library answer goes through the answer driver (ragkv.driver), a batch of one.

Exactness: the library's answers on the tiny models are the texts recorded from the code before
(``library_answers.json``, made by ``python -m tests.core.library_answers`` when ``RagKV.answer``
still ran its own static decoder), greedy and sampled, reuse and full, framework segments, int8.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ragkv.driver import JobRequest, answer_inline
from ragkv.engine import EngineConfig, RagKV
from ragkv.fusion import FusionConfig
from ragkv.generation import GenerationConfig
from ragkv.retriever.embedder import HashingEmbedder
from tests.core.library_answers import CASES, DOCS, answers

RECORDED = json.loads((Path(__file__).parent / "library_answers.json").read_text())


@pytest.mark.parametrize(
    "family, weights",
    [pytest.param(f, w, marks=() if (f, w) == CASES[0] else pytest.mark.slow) for f, w in CASES],
)
def test_the_library_answers_as_before_the_one_driver(tmp_path, family, weights):
    got, want = answers(family, weights, tmp_path), RECORDED[f"{family}/{weights}"]
    assert got.keys() == want.keys()
    for case, (text, tokens) in want.items():
        assert got[case][0] == text, case
        if case.startswith("stop/"):  # a stop string's last token now counts (the server counted it before too)
            assert got[case][1] - tokens in (0, 1), case
        else:
            assert got[case][1] == tokens, case


def _engine(tmp_path: Path, adapter, **kw) -> RagKV:
    cfg = EngineConfig(data_dir=tmp_path, store=("memory://", str(tmp_path / "kv")), **kw)
    return RagKV(cfg, adapter=adapter, embedder=HashingEmbedder(dim=64))


def test_library_stats_carry_the_drivers_finish_reason_ttft_and_deadline(tmp_path, llama_adapter):
    from ragkv.planner.config import LoadConfig

    with _engine(tmp_path, llama_adapter, load=LoadConfig(slo_ms=60_000)) as rag:
        rag.index(DOCS, progress=False)
        length = rag.answer("Where do apples grow?", generation=GenerationConfig(max_new_tokens=3, ignore_eos=True))
        s = length.stats
        assert s.extra["finish_reason"] == "length" and s.generated_tokens == 3
        assert 0 < s.ttft_ms <= s.total_ms
        assert s.extra["load"]["deadline_met"] is True  # the first token came within the minute
        chat = "<|im_start|>user\nName three things that float.<|im_end|>\n<|im_start|>assistant\n"
        parts = list(rag.generate_segments([chat], generation=GenerationConfig(max_new_tokens=40, stop=("\x00",))))
        assert parts[-1][1].extra["finish_reason"] in ("stop", "length")


def test_a_reader_that_stops_early_frees_its_row_and_the_next_answer_is_whole(tmp_path, llama_adapter):
    gen = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    with _engine(tmp_path, llama_adapter) as rag:
        want = "".join(d for d, _ in rag.generate_segments(["Once upon a time"], generation=gen))
        stream = rag.generate_segments(["Once upon a time"], generation=gen)
        next(stream)
        stream.close()  # the caller left after its first piece of text
        again = "".join(d for d, _ in rag.generate_segments(["Once upon a time"], generation=gen))
    assert again == want


def test_bad_input_is_raised_to_the_caller_not_posted(tmp_path, llama_adapter):
    with _engine(tmp_path, llama_adapter) as rag:
        request = JobRequest(rag, GenerationConfig(max_new_tokens=2), "sideways", rag=(["A chunk."], "q?"))
        with pytest.raises(ValueError, match="mode must be"):
            list(answer_inline(request, rag.adapter, rag.decode_weights))
        fused = JobRequest(rag, GenerationConfig(max_new_tokens=2), rag=(["A chunk."], "q?"), fusion=FusionConfig())
        assert [e.kind for e in answer_inline(fused, rag.adapter, rag.decode_weights)][-1] == "done"
