"""``ragkv bench qa``: scoring against gold, the shipped QA sets, their prompts, and a run on a tiny model."""

from __future__ import annotations

import doctest
import importlib
import json
import os
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ragkv.bench import qa as bench_qa
from ragkv.bench.qa import merge_results, parse_methods, run_qa_bench
from ragkv.bench.qa_data import QA_SETS, QASet, build_prompt, documents_text, load_qa_set, pick_documents
from ragkv.bench.qa_score import best_f1, contains_answer, normalize, token_f1
from ragkv.cli import app
from ragkv.selection import QueryFocusParams

# ---- scoring -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ragkv.bench.qa_score", "ragkv.bench.qa"])
def test_doctests(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_normalize_folds_case_accents_articles_and_number_punctuation() -> None:
    assert normalize("The MV Orrin Star") == ["mv", "orrin", "star"]
    assert normalize("9,000 eggs") == normalize("9000 eggs") == ["9000", "eggs"]
    assert normalize("4.5 km.") == ["4.5", "km"]  # a decimal point stays, a full stop goes
    assert normalize("Ferreira-Doyle") == ["ferreira", "doyle"]
    assert normalize("Señor Ōta") == ["senor", "ota"]
    assert normalize("1,2,3") == ["1", "2", "3"]  # commas that are not thousands separators split
    assert normalize("") == []


def test_containment_matches_whole_token_runs_only() -> None:
    assert contains_answer("The capital is Port Tessaly.", ["Port Tessaly"])
    assert contains_answer("port  tessaly", ["Port Tessaly"])
    assert not contains_answer("Port of Tessaly", ["Port Tessaly"])  # not a contiguous run
    assert not contains_answer("Sable Harbour", ["Port Tessaly"])
    assert contains_answer("about 9000", ["9,000", "nine thousand"])  # any alias
    assert not contains_answer("47810", ["4"])  # never a substring of a token
    assert not contains_answer("4.5 km", ["4"])
    assert contains_answer("It is 1,214 m.", ["1214"])
    assert not contains_answer("anything", [])


def test_token_f1_is_squad_f1_and_best_over_aliases() -> None:
    assert token_f1("Port Tessaly", "Port Tessaly") == 1.0
    assert token_f1("Tessaly", "Port Tessaly") == pytest.approx(2 * 1.0 * 0.5 / 1.5)
    assert token_f1("Port Tessaly harbour town", "Port Tessaly") == pytest.approx(2 * 0.5 * 1.0 / 1.5)
    assert token_f1("", "") == 1.0 and token_f1("x", "") == 0.0 and token_f1("", "x") == 0.0
    assert token_f1("a the an", "") == 1.0  # articles only: nothing left on either side
    assert best_f1("1214", ["1,214 metres", "1214"]) == 1.0
    assert best_f1("1214 metres", ["1,214 metres", "1214"]) == 1.0
    assert best_f1("anything", []) == 0.0


# ---- the shipped sets ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qa() -> QASet:
    return load_qa_set()


@pytest.fixture(scope="module", params=sorted(QA_SETS))
def shipped(request) -> QASet:
    """Each shipped set: the invented one defaults are tuned on, and the held-out one."""
    return load_qa_set(request.param)


def test_the_default_set_is_the_invented_one_and_the_held_out_one_loads_by_name(qa: QASet) -> None:
    assert qa.name == load_qa_set("invented").name == "invented-v1"
    heldout = load_qa_set("heldout")
    assert heldout.name == "heldout-v1" and len(heldout.documents) == 10
    assert [q.id for q in heldout.questions] == [f"h{n:02d}" for n in range(1, 37)]


def test_the_held_out_set_shares_no_document_with_the_invented_one(qa: QASet) -> None:
    heldout = load_qa_set("heldout")
    assert not {d.title for d in qa.documents.values()} & {d.title for d in heldout.documents.values()}
    assert not set(qa.documents) & set(heldout.documents)
    assert not any("Serrat" in d.text or "Kessarin" in d.text for d in heldout.documents.values())  # another world


def test_the_held_out_set_is_dense_with_numbers_and_computed_answers() -> None:
    heldout = load_qa_set("heldout")
    assert all(250 <= len(d.text.split()) <= 330 for d in heldout.documents.values())  # as long as the invented ones
    numeric = [q for q in heldout.questions if any(c.isdigit() for c in q.answers[0])]
    assert len(numeric) >= 18  # numeric answers are where fusion loses today
    assert any("," in q.answers[0] for q in numeric) and any(":" in q.answers[0] for q in numeric)
    assert any("." in q.answers[0] for q in numeric)  # a decimal
    assert 3 <= sum(q.computed for q in heldout.questions) <= 8


def test_shipped_set_has_the_shape_the_issue_asks_for(shipped: QASet) -> None:
    qa = shipped
    assert len(qa.documents) >= 10 and len(qa.questions) >= 30
    for doc in qa.documents.values():
        assert 250 <= len(doc.text.split()) <= 600, doc.id
    two = [q for q in qa.questions if len(q.docs) == 2]
    assert len(two) * 3 >= len(qa.questions)  # a third need two documents
    assert sum(bool(q.near_miss) for q in qa.questions) >= 10
    assert len({q.id for q in qa.questions}) == len(qa.questions)
    assert all(not set(q.near_miss) & set(q.docs) for q in qa.questions)
    assert all(set(q.docs) | set(q.near_miss) <= set(qa.documents) for q in qa.questions)
    assert set(Counter(d for q in qa.questions for d in q.docs)) == set(qa.documents)  # every document is used


def test_every_span_answer_is_in_a_needed_document_and_nowhere_else_for_single_doc_questions(shipped: QASet) -> None:
    qa = shipped
    for q in qa.questions:
        if q.computed:
            continue
        assert contains_answer(documents_text(qa, q.docs), q.answers[:1]), q.id
        assert any(a in documents_text(qa, q.docs) for a in q.answers), f"{q.id}: no alias verbatim in its docs"
        if len(q.docs) == 1:  # the near-miss documents hold a similar fact, never the answer itself
            assert not contains_answer(documents_text(qa, q.near_miss), q.answers[:1]), q.id


def test_a_chained_question_cannot_be_answered_from_the_document_holding_the_answer_alone(qa: QASet) -> None:
    # q23 names the protocol by its timeout, which only the protocol's document gives
    q = next(q for q in qa.questions if q.id == "q23")
    assert "750" in documents_text(qa, ["ferrule"]) and "750" not in documents_text(qa, ["halvorsen"])
    assert not contains_answer(documents_text(qa, ["ferrule"]), q.answers)


def test_every_question_of_a_shipped_set_gets_a_prompt(shipped: QASet) -> None:
    for q in shipped.questions:
        prompt = build_prompt(shipped, q, lambda t: 3 * len(t.split()), seed=0)
        assert set(q.docs) <= set(prompt["docs"]) and prompt["chunks"] and prompt["question"] == q.question


def test_set_with_an_unknown_document_is_refused_with_the_known_ones() -> None:
    data = {
        "documents": [{"id": "a", "title": "A", "text": "x"}],
        "questions": [{"id": "q", "question": "?", "answers": ["x"], "docs": ["b"]}],
    }
    with pytest.raises(ValueError, match=r"unknown: \['b'\].*known: \['a'\]"):
        QASet.from_dict(data)


def test_a_malformed_set_is_refused_saying_what_is_wrong(tmp_path: Path) -> None:
    doc = {"id": "a", "title": "A", "text": "x"}
    question = {"id": "q", "question": "?", "answers": ["x"], "docs": ["a"]}
    with pytest.raises(ValueError, match=r"not a QA set \(KeyError: 'questions'\).*qa_invented.json"):
        QASet.from_dict({"documents": [doc]})
    with pytest.raises(ValueError, match="must each be unique"):
        QASet.from_dict({"documents": [doc], "questions": [question, question]})
    with pytest.raises(ValueError, match="neither a shipped QA set \\(heldout, invented\\) nor a file"):
        load_qa_set(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json: not JSON"):
        load_qa_set(bad)
    bad.write_text(json.dumps([doc]))  # a list, not a set
    with pytest.raises(ValueError, match="bad.json: not a QA set"):
        load_qa_set(bad)
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"name": "mine", "documents": [doc], "questions": [question]}))
    assert load_qa_set(str(good)).name == "mine"


def test_prompts_hold_needed_docs_near_misses_and_one_or_two_distractors_seeded(qa: QASet) -> None:
    counts = Counter()
    for q in qa.questions:
        ids = pick_documents(qa, q, seed=0)
        assert ids == pick_documents(qa, q, seed=0)
        assert set(q.docs) <= set(ids) and len(set(ids)) == len(ids)
        extra = [d for d in ids if d not in q.docs]
        assert 1 <= len(extra) <= 2
        assert set(q.near_miss[: len(extra)]) <= set(extra)
        counts[ids.index(q.docs[0])] += 1
    assert len(counts) > 1  # the needed document is not always first
    assert any(pick_documents(qa, q, seed=1) != pick_documents(qa, q, seed=0) for q in qa.questions)


def test_prompt_chunks_are_the_documents_cut_as_ragkv_indexes_them(qa: QASet) -> None:
    q = qa.questions[0]
    prompt = build_prompt(qa, q, lambda t: 3 * len(t.split()), seed=0)  # ~900 "tokens" a document
    words = [w for d in prompt["docs"] for w in qa.documents[d].text.split()]
    assert [w for c in prompt["chunks"] for w in c.split()] == words  # tiled, nothing lost or repeated
    assert len(prompt["chunks"]) > len(prompt["docs"])  # chunks of 256-512 "tokens": documents split
    assert prompt["question"] == q.question and prompt["system"]


# ---- a run on a tiny random-weight model --------------------------------------------------------


def test_bench_on_a_tiny_model_gives_a_row_per_method_and_full_is_its_own_reference(tiny_tokenizer, qa) -> None:
    from ragkv.model import ModelAdapter
    from tests.conftest import make_model

    # the tokenizer has one token per byte: the shipped documents, cut short, keep prompts ~2K tokens
    short = QASet(qa.name, {k: replace(d, text=d.text[:600]) for k, d in qa.documents.items()}, qa.questions)
    adapter = ModelAdapter(make_model("qwen2", len(tiny_tokenizer)), tiny_tokenizer, name="tiny-qwen2")
    methods = parse_methods("naive,blend:1.0,default")
    seen: list[str] = []
    result = run_qa_bench(adapter, short, methods, limit=2, max_tokens=4, on_question=lambda r: seen.append(r["id"]))

    meta = result["meta"]
    assert meta["model"] == "tiny-qwen2" and meta["dtype"] == "float32" and meta["questions"] == 2
    assert meta["default_fusion"] == "query_focus:0.15 (default)"
    rows = {r["method"]: r for r in result["rows"]}
    assert list(rows) == ["full", "naive", "blend:1", "query_focus:0.15 (default)"]
    for r in rows.values():
        assert r["questions"] == 2 and 0 <= r["correct"] <= 2 and r["right"] == f"{r['correct']}/2"
        assert 0.0 <= r["accuracy"] <= 1.0 and 0.0 <= r["f1_gold"] <= 1.0 and r["dtype"] == "float32"
        assert r["kl"] > -1e-6 and r["ttft_ms"] > 0.0  # KL is >= 0 up to rounding
    full = rows["full"]
    assert full["kl"] == 0.0 and full["same_as_full"] == 1.0 and full["f1_full"] == 1.0 and full["ttft_ratio"] == 1.0
    assert rows["naive"]["recompute"] == 0.0
    # recomputing every chunk token is full prefill: the fused path itself agrees with it
    assert rows["blend:1"]["recompute"] == 1.0
    assert rows["blend:1"]["kl"] < 1e-4 and rows["blend:1"]["same_as_full"] == 1.0
    assert 0.0 < rows["query_focus:0.15 (default)"]["recompute"] < 0.5

    assert [q["id"] for q in result["questions"]] == seen == ["q01", "q02"]
    for q in result["questions"]:
        assert set(q["methods"]) == set(rows)
        for got in q["methods"].values():
            assert got["correct"] == contains_answer(got["answer"], q["gold"])


def _flat(text: str) -> str:
    return " ".join(text.replace("│", " ").split())


def test_the_command_runs_the_set_qa_set_names_and_records_it(llama_adapter, monkeypatch, tmp_path) -> None:
    monkeypatch.setattr("ragkv.cli.bench._load_model", lambda *a, **k: llama_adapter)
    real = bench_qa.run_qa_bench
    seen: list[str] = []

    def short(adapter, qa, *args, **kwargs):  # the documents cut short: one tiny forward pass per method
        seen.append(qa.name)
        docs = {k: replace(d, text=d.text[:200]) for k, d in qa.documents.items()}
        return real(adapter, QASet(qa.name, docs, qa.questions), *args, **kwargs)

    monkeypatch.setattr(bench_qa, "run_qa_bench", short)
    out = tmp_path / "heldout.json"
    args = ["bench", "qa", "--methods", "full", "--limit", "1", "--max-tokens", "1", "--json", str(out)]
    result = CliRunner().invoke(app, [*args, "--qa-set", "heldout"])
    assert result.exit_code == 0, result.output
    meta = json.loads(out.read_text())["meta"]
    assert meta["qa_set"] == "heldout-v1" and seen == ["heldout-v1"]
    assert json.loads(out.read_text())["questions"][0]["id"] == "h01"
    assert not (tmp_path / "heldout.json.partial.jsonl").exists()  # a finished run leaves no checkpoint


def test_the_command_refuses_a_missing_or_malformed_set_before_loading_a_model(monkeypatch, tmp_path) -> None:
    def no_model(*a, **k):
        raise AssertionError("the set is checked before the model loads")

    monkeypatch.setattr("ragkv.cli.bench._load_model", no_model)
    result = CliRunner().invoke(app, ["bench", "qa", "--qa-set", str(tmp_path / "nope.json")])
    assert result.exit_code == 2
    assert "neither a shipped QA set (heldout, invented) nor a file" in _flat(result.output)
    bad = tmp_path / "bad.json"
    bad.write_text('{"documents": []}')
    result = CliRunner().invoke(app, ["bench", "qa", "--qa-set", str(bad)])
    assert result.exit_code == 2 and "not a QA set" in _flat(result.output)


def test_one_token_answers_are_compared_without_an_empty_forward_pass(tiny_tokenizer) -> None:
    from ragkv.bench.fusion import compare_methods
    from ragkv.model import ModelAdapter
    from tests.conftest import make_model

    adapter = ModelAdapter(make_model("llama", len(tiny_tokenizer)), tiny_tokenizer, name="tiny-llama")
    prompt = {"chunks": ["The ferry takes three hours.", "The island has one town."], "question": "How long?"}
    rows = compare_methods(adapter, prompt, [("full", 1.0), ("blend", 1.0)], answer_tokens=1)
    assert len(rows[0]["answer"]) == 1 and rows[0]["kl"] == 0.0
    assert rows[1]["kl"] < 1e-4  # every token recomputed: full prefill, through the fused path


def test_a_methods_knobs_parse_into_its_params_record() -> None:
    (_, m) = parse_methods("query_focus:0.3:coverage=0.8+min_ratio=0.1")
    assert m.label == "query_focus:0.3:coverage=0.8+min_ratio=0.1"
    assert m.grid_entry() == ("query_focus", 0.3, QueryFocusParams(coverage=0.8, min_ratio=0.1))
    with pytest.raises(ValueError, match="coverage must be in"):
        parse_methods("query_focus:0.3:coverage=8")


def test_runs_over_disjoint_questions_merge_into_the_rows_of_one_run() -> None:
    def run(qid: str, right: bool, ttft: float) -> dict:
        got = dict(answer="x", correct=right, f1_gold=float(right), kl=0.5, same_as_full=0.0, f1_full=0.5)
        got.update(recompute=0.1, ttft_ms=ttft, ttft_ratio=ttft / 100)
        full = dict(got, correct=True, f1_gold=1.0, kl=0.0, same_as_full=1.0, f1_full=1.0, ttft_ms=100.0)
        meta = dict(model="m", dtype="float32", qa_set="s", seed=0, max_tokens=8, default_fusion="d", questions=1)
        question = dict(id=qid, question="?", gold=["x"], docs=["a"], needs=1, methods={"full": full, "naive": got})
        return {"meta": meta, "rows": [], "questions": [question]}

    merged = merge_results([run("q03", False, 30.0), run("q01", True, 10.0), run("q02", True, 20.0)])
    assert [q["id"] for q in merged["questions"]] == ["q01", "q02", "q03"] and merged["meta"]["questions"] == 3
    naive = merged["rows"][1]
    assert naive["method"] == "naive" and naive["right"] == "2/3" and naive["ttft_ms"] == 20.0
    with pytest.raises(ValueError, match="disjoint"):
        merge_results([run("q01", True, 1.0), run("q01", True, 1.0)])
    other = run("q09", True, 1.0)
    other["meta"]["dtype"] = "bfloat16"
    with pytest.raises(ValueError, match="dtype"):
        merge_results([run("q01", True, 1.0), other])


# ---- a real model (opt-in) -----------------------------------------------------------------------


@pytest.mark.realmodel
def test_qa_bench_on_the_real_model_named_by_the_environment(tmp_path: Path, monkeypatch) -> None:
    path = os.environ.get("RAGKV_TEST_REAL_MODEL", "")
    if not path.endswith(".gguf") or not Path(path).is_file():
        pytest.skip("set RAGKV_TEST_REAL_MODEL to a .gguf file (e.g. fetch-model.sh qwen2.5-0.5b) to run this")
    from ragkv.model import load_model

    monkeypatch.setenv("RAGKV_MODEL_CACHE", str(tmp_path / "models"))  # never the user's conversion cache
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    adapter = load_model(path, dtype="float32", offline=True)
    result = run_qa_bench(adapter, methods=parse_methods("naive,default"), limit=3, max_tokens=16)

    rows = {r["method"]: r for r in result["rows"]}
    assert rows["full"]["questions"] == 3 and rows["full"]["kl"] == 0.0
    assert rows["full"]["correct"] >= 2  # a real instruct model reads these single-document answers
    fused = rows["query_focus:0.15 (default)"]
    assert 0.0 < fused["recompute"] < 0.5 and fused["kl"] >= 0.0


def test_answers_decoded_by_decode_steps_equal_the_models_own_forward(tiny_tokenizer, qa) -> None:
    """``--decode-weights``: the answers go through decode steps (one row); with the model's weights they equal
    the slow path (the model's own forward per token), and int8 is named in the result."""
    from ragkv.bench.fusion import compare_methods
    from ragkv.model import ModelAdapter
    from tests.conftest import make_model

    adapter = ModelAdapter(make_model("llama", len(tiny_tokenizer)), tiny_tokenizer, name="tiny-llama")
    prompt = {"chunks": ["The ferry takes three hours.", "The island has one town."], "question": "How long?"}
    grid = [("full", 1.0), ("naive", 0.0)]
    slow = compare_methods(adapter, prompt, grid, answer_tokens=6)
    fast = compare_methods(adapter, prompt, grid, answer_tokens=6, decode_weights="model")
    assert [r["answer"] for r in fast] == [r["answer"] for r in slow]
    assert [r["kl"] for r in fast] == [r["kl"] for r in slow]  # KL compares the model's own logits either way
    short = QASet(qa.name, {k: replace(d, text=d.text[:300]) for k, d in qa.documents.items()}, qa.questions)
    result = run_qa_bench(adapter, short, parse_methods("full"), limit=1, max_tokens=3, decode_weights="int8")
    assert result["meta"]["decode_weights"] == "int8" and len(result["questions"]) == 1
