"""Chunk finding: exact, trimmed, split, repeated and overlapping texts; segments always rebuild the prompt."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ragkv.engine import CachedText
from ragkv.matching import SEPARATOR, ChunkRegistry, MatchConfig, chunk_forms, split_prompt

A = "Apples grow on trees in orchards across the valley."
B = "Boats float on water and carry people over the lake."
C = "Clocks measure time with gears, springs and a pendulum."
CFG = MatchConfig(min_chars=16)


def cached(segments) -> list[str]:
    return [s.text for s in segments if isinstance(s, CachedText)]


def rebuilt(segments) -> str:
    return "".join(s.text if isinstance(s, CachedText) else s for s in segments)


def test_no_registered_text_in_prompt_is_one_plain_segment():
    prompt = "<|im_start|>user\nWhat time is it?<|im_end|>\n"
    assert split_prompt(prompt, [A, B], config=CFG) == [prompt]
    assert split_prompt(prompt, [], config=CFG) == [prompt]


def test_exact_texts_joined_by_separator_take_the_separator_with_them():
    prompt = f"Context:\n{A}{SEPARATOR}{B}{SEPARATOR}Question: why?"
    segs = split_prompt(prompt, [A, B], config=CFG)
    assert segs == ["Context:\n", CachedText(A + SEPARATOR), CachedText(B + SEPARATOR), "Question: why?"]


def test_last_chunk_without_separator_is_found_bare():
    prompt = f"Context:\n{A}{SEPARATOR}{B}\n-----\nQuestion: why?"
    assert cached(split_prompt(prompt, [A, B], config=CFG)) == [A + SEPARATOR, B]


def test_trimmed_text_is_found_stripped():
    registered = f"  \n{A}  \n"
    prompt = f"Context: {A}\nQuestion?"
    assert cached(split_prompt(prompt, [registered], config=CFG)) == [A]


def test_split_text_is_found_paragraph_by_paragraph():
    registered = f"{A}{SEPARATOR}{B}{SEPARATOR}{C}"
    prompt = f"Part one: {A}\n---\nPart two: {C}\nQuestion?"  # the framework cut it and dropped B
    assert cached(split_prompt(prompt, [registered], config=CFG)) == [A, C]
    assert cached(split_prompt(prompt, [registered], config=MatchConfig(min_chars=16, pieces=False))) == []


def test_rejoined_text_is_found_whole_when_intact():
    registered = f"{A}{SEPARATOR}{B}"
    prompt = f"ctx: {A}{SEPARATOR}{B}{SEPARATOR}q"
    assert cached(split_prompt(prompt, [registered], config=CFG)) == [registered + SEPARATOR]


def test_changed_text_is_left_plain_never_mismatched():
    prompt = f"ctx: {A.replace(' ', '  ')} and {B.upper()} q"
    assert split_prompt(prompt, [A, B], config=CFG) == [prompt]


def test_repeated_text_is_cached_at_every_occurrence():
    prompt = f"first {A} then again {A} end"
    assert cached(split_prompt(prompt, [A], config=CFG)) == [A, A]


def test_overlapping_registrations_longest_claims_first_and_nothing_overlaps():
    long = f"{A} {B}"
    prompt = f"x {long} y {B} z"
    segs = split_prompt(prompt, [B, long], config=CFG)
    assert cached(segs) == [long, B]
    assert rebuilt(segs) == prompt


def test_partially_overlapping_texts_keep_one_and_leave_the_rest_plain():
    left, right = f"{A} {B}", f"{B} {C}"  # overlapping windows of a splitter with overlap
    prompt = f"x {A} {B} {C} y"
    segs = split_prompt(prompt, [left, right], config=CFG)
    assert len(cached(segs)) == 1 and cached(segs)[0] in (left, right)
    assert rebuilt(segs) == prompt


def test_short_texts_are_never_matched():
    prompt = "the cat sat on the mat"
    assert split_prompt(prompt, ["cat"], config=MatchConfig(min_chars=8)) == [prompt]


def test_a_chunk_ending_the_prompt_stays_plain_when_a_suffix_is_required():
    prompt = f"ctx: {A}"
    assert split_prompt(prompt, [A], config=CFG) == [prompt]
    assert split_prompt(prompt, [A], config=CFG, require_suffix=False) == ["ctx: ", CachedText(A)]


def test_a_chunk_starting_the_prompt_is_cached():
    assert split_prompt(f"{A} q", [A], config=CFG) == [CachedText(A), " q"]


def test_forms_priority_exact_then_stripped_then_listed_then_pieces():
    forms = chunk_forms(f" {A}{SEPARATOR}{B} ", CFG)
    assert [p for p, _ in forms] == sorted(p for p, _ in forms)
    assert forms[0] == (0, f" {A}{SEPARATOR}{B} {SEPARATOR}")
    assert (2, f"{A}\\n\\n{B}") in forms
    assert (3, A) in forms and (3, B + SEPARATOR) in forms


def test_min_chars_must_be_positive():
    with pytest.raises(ValueError, match="min_chars"):
        MatchConfig(min_chars=0)


def test_registry_is_bounded_and_most_recent_wins():
    reg = ChunkRegistry(capacity=2, config=CFG)
    reg.add([A, B])
    reg.add([A])  # A becomes the most recent
    reg.add([C])  # evicts B
    assert A in reg and C in reg and B not in reg and len(reg) == 2
    assert cached(reg.split(f"x {A} {B} {C} y")) == [A, C]


def test_registry_rejects_a_bare_string():
    with pytest.raises(TypeError, match="wrap a single text"):
        ChunkRegistry().add(A)


def test_registry_with_many_texts_uses_the_anchor_filter_and_finds_the_same():
    texts = [f"Filler document number {i} talks about topic {i * 7}." for i in range(300)] + [A, B]
    reg = ChunkRegistry(config=CFG)
    reg.add(texts)
    prompt = f"ctx {texts[5]}{SEPARATOR}{A}{SEPARATOR}{texts[250]} q"
    assert reg.split(prompt) == split_prompt(prompt, texts, config=CFG)
    assert cached(reg.split(prompt)) == [texts[5] + SEPARATOR, A + SEPARATOR, texts[250]]


def test_registry_is_safe_under_concurrent_add_and_split():
    reg = ChunkRegistry(config=CFG)
    prompt = f"ctx {A}{SEPARATOR}{B} q"
    errors: list[BaseException] = []

    def adder(i: int) -> None:
        try:
            for j in range(200):
                reg.add([f"text {i}-{j} padded to be long enough to match"])
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    def splitter() -> None:
        try:
            for _ in range(200):
                assert rebuilt(reg.split(prompt)) == prompt
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    reg.add([A, B])
    threads = [threading.Thread(target=adder, args=(i,)) for i in range(3)] + [threading.Thread(target=splitter)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


_words = st.sampled_from(["alpha", "beta", "gamma", "delta", "\n", "\n\n", " ", "x", "Q:"])


@settings(max_examples=150, deadline=None)
@given(
    texts=st.lists(st.lists(_words, min_size=1, max_size=12).map("".join), min_size=1, max_size=5),
    picks=st.lists(st.tuples(st.integers(0, 4), st.lists(_words, max_size=4).map("".join)), max_size=8),
)
def test_segments_always_rebuild_the_prompt_and_are_registered_forms(texts, picks):
    prompt = "".join(texts[i % len(texts)] + filler for i, filler in picks) + "end"
    cfg = MatchConfig(min_chars=3)
    segs = split_prompt(prompt, texts, config=cfg)
    assert rebuilt(segs) == prompt
    allowed = {form for t in texts for _, form in chunk_forms(t, cfg)}
    assert all(s.text in allowed for s in segs if isinstance(s, CachedText))
    assert not isinstance(segs[-1], CachedText)


@settings(max_examples=150, deadline=None)
@given(
    texts=st.lists(st.lists(_words, min_size=1, max_size=12).map("".join), min_size=1, max_size=5),
    picks=st.lists(st.tuples(st.integers(0, 4), st.lists(_words, max_size=4).map("".join)), max_size=8),
    min_chars=st.sampled_from([3, 20]),
)
def test_registry_anchor_index_finds_exactly_what_a_full_scan_finds(texts, picks, min_chars):
    prompt = "".join(texts[i % len(texts)] + filler for i, filler in picks) + "end"
    cfg = MatchConfig(min_chars=min_chars)
    reg = ChunkRegistry(config=cfg)
    reg.add(texts[:2])
    reg.add(texts[2:], pinned=True)
    assert reg.split(prompt) == split_prompt(prompt, texts, config=cfg)


def test_chunk_list_printed_into_the_prompt_is_found_in_its_escaped_form():
    a, b = A + "\nIt's sunny.", B + "\n\nSecond paragraph here, long enough."
    prompt = f"Context:\n{[a, b]}\nQuestion: why?"  # what simple_summarize builds in llama-index 0.14
    assert cached(split_prompt(prompt, [a, b], config=CFG)) == [repr(a)[1:-1], repr(b)[1:-1]]


def test_pinned_texts_outlive_capacity_and_unpin_all_forgets_them():
    reg = ChunkRegistry(capacity=1, config=CFG)
    reg.add([A, B], pinned=True)
    reg.add([C])
    assert cached(reg.split(f"x {A} {B} {C} y")) == [A, B, C] and len(reg) == 3
    reg.unpin_all()
    assert A not in reg and cached(reg.split(f"x {A} {B} {C} y")) == [C]
