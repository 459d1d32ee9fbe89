"""The fusion bench's index-time contexts for the craft methods: other prompts' chunks, never its own."""

from __future__ import annotations

from ragkv.bench.fusion import craft_contexts, needs_stored_scores

PROMPTS = [
    {"chunks": ["a", "b", "c"]},
    {"chunks": ["b", "d", "e", "f"]},  # shares "b" with the first prompt
    {"chunks": ["g", "a"]},
]


def test_contexts_come_from_other_prompts_and_never_from_its_own_chunks():
    for i, prompt in enumerate(PROMPTS):
        drawn = craft_contexts(PROMPTS, i, k=2)
        assert len(drawn) == len(prompt["chunks"])
        others = {c for j, p in enumerate(PROMPTS) if j != i for c in p["chunks"]} - set(prompt["chunks"])
        for texts in drawn:
            assert len(texts) == 2 and len(set(texts)) == 2 and set(texts) <= others


def test_contexts_are_seeded_and_repeatable():
    assert craft_contexts(PROMPTS, 1, k=2) == craft_contexts(PROMPTS, 1, k=2)
    assert [sorted(t) for t in craft_contexts(PROMPTS, 0, k=9)] == [["d", "e", "f", "g"]] * 3  # "b" is its own
    assert craft_contexts([{"chunks": ["x", "y"]}], 0) == [[], []]  # no other prompt: nothing to draw


def test_only_the_craft_methods_need_stored_scores():
    assert needs_stored_scores([("naive", 0.0), ("craft", 0.1)])
    assert needs_stored_scores([("craft_query", 0.1)])
    assert not needs_stored_scores([("query_focus", 0.15), ("full", 1.0)])


def test_fit_chunks_keeps_the_leading_chunks_that_fit_and_cuts_only_a_first_too_long_one():
    from ragkv.bench.fusion import fit_chunks

    assert fit_chunks(2, [[1] * 3, [2] * 5, [3] * 5], 10) == [[1] * 3, [2] * 5]
    assert fit_chunks(2, [[1] * 5, [2] * 5], 10) == [[1] * 5]
    assert fit_chunks(2, [[1] * 20], 10) == [[1] * 8]
