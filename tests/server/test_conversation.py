"""Server-side retrieval follows the conversation: a short follow-up searches with the turn it follows."""

from __future__ import annotations

import pytest

from ragkv.server.openai_api import FOLLOW_UP_WORDS, QUERY_MAX_CHARS, rag_question, retrieval_query

FOLLOW_UP = "And what else do they do?"


def test_a_short_follow_up_takes_the_previous_user_turn():
    assert retrieval_query(["Where do apples grow?", FOLLOW_UP]) == f"Where do apples grow?\n{FOLLOW_UP}"


def test_a_self_contained_question_stands_alone():
    long_question = "What do boats carry across the lakes and along the rivers of the valley?"
    assert len(long_question.split()) >= FOLLOW_UP_WORDS
    assert retrieval_query(["Where do apples grow?", long_question]) == long_question


def test_a_chain_of_short_turns_reaches_back_two_turns_at_most():
    turns = ["Tell me about the harbour.", "Boats?", "Sails?", "Why?"]
    assert retrieval_query(turns) == "Boats?\nSails?\nWhy?"
    assert retrieval_query(["  ", "Why?"]) == "Why?"  # empty turns are skipped
    assert retrieval_query([]) == ""


def test_the_query_is_capped_at_its_end():
    query = retrieval_query(["word " * 1000, "And then?"])
    assert len(query) == QUERY_MAX_CHARS and query.endswith("\nAnd then?")


@pytest.mark.parametrize(("first", "source"), [("Where do apples grow?", "mem:apples"),
                                               ("What do boats carry?", "mem:boats")])  # fmt: skip
def test_the_follow_up_retrieves_the_chunk_the_previous_turn_was_about(server, first, source):
    messages = [
        {"role": "user", "content": first},
        {"role": "assistant", "content": "They are described in the documents."},
        {"role": "user", "content": FOLLOW_UP},
    ]
    with server.client() as c:
        body = {"messages": messages, "max_tokens": 2, "ragkv": {"retrieve": True, "top_k": 1}}
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert [s["source"] for s in r.json()["ragkv"]["sources"]] == [source]


def test_the_model_reads_the_earlier_turns_after_the_last_question():
    chat = [("system", "Be brief."), ("user", "Where do apples grow?"), ("assistant", "In orchards.")]
    chat.append(("user", "When?"))
    history = "user: Where do apples grow?\nassistant: In orchards."
    assert rag_question(chat) == f"When?\n\nEarlier in this conversation:\n{history}\n\nAnswer the last question: When?"
    assert rag_question(chat[:2]) == ""  # one user turn: the retrieval query is the question, as before


def test_a_multi_turn_chat_carries_its_history_and_reuses_the_same_chunk_caches(server):
    first = {"role": "user", "content": "Where do apples grow?"}
    turns = [first, {"role": "assistant", "content": "In orchards."}, {"role": "user", "content": "Who picks them?"}]
    usages = []
    with server.client() as c:
        for messages in ([first], turns):
            body = {"messages": messages, "max_tokens": 2, "ragkv": {"retrieve": True, "top_k": 1}}
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            usages.append(r.json()["usage"])
    assert usages[1]["prompt_tokens"] > usages[0]["prompt_tokens"]  # the earlier turns are in the prompt
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    assert cached[0] > 0 and cached[1] == cached[0]  # and the chunk caches are reused all the same
