"""Scoring short answers against gold: normalization, containment and token F1 (SQuAD-style).

A model's answer is right when any gold alias, normalized, appears in the normalized answer as a
run of whole tokens: "1,214 metres" contains the alias "1214", but "47810" does not contain "4".
Token F1 is the SQuAD measure, the best over the aliases.

Normalization lowercases, folds accents, drops thousands separators inside numbers ("11,515" ->
"11515"), keeps decimal points ("4.5"), turns other punctuation (hyphens and slashes included)
into spaces, and drops the articles "a", "an" and "the".
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Sequence

__all__ = ["normalize", "contains_answer", "token_f1", "best_f1"]

_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")
_DECIMAL = re.compile(r"(?<=\d)\.(?=\d)")
_PUNCT = re.compile(r"[^\w\s\x00]|_")
_ARTICLES = frozenset({"a", "an", "the"})
_POINT = "\x00"  # stands in for a decimal point while other punctuation is removed


def normalize(text: str) -> list[str]:
    """The tokens of ``text`` that scoring compares.

    >>> normalize("The Calloway Light, 38 m!")
    ['calloway', 'light', '38', 'm']
    >>> normalize("11,515 residents; 4.5 km; CRC-16/CCITT")
    ['11515', 'residents', '4.5', 'km', 'crc', '16', 'ccitt']
    >>> normalize("Région  Séverine")
    ['region', 'severine']
    """
    folded = unicodedata.normalize("NFKD", text.lower())
    folded = "".join(c for c in folded if not unicodedata.combining(c))
    folded = _DECIMAL.sub(_POINT, _THOUSANDS.sub("", folded))
    folded = _PUNCT.sub(" ", folded).replace(_POINT, ".")
    return [t for t in folded.split() if t not in _ARTICLES]


def _contains(tokens: Sequence[str], run: Sequence[str]) -> bool:
    n = len(run)
    return n > 0 and any(list(tokens[i : i + n]) == list(run) for i in range(len(tokens) - n + 1))


def contains_answer(answer: str, golds: Sequence[str]) -> bool:
    """Whether any of ``golds``, normalized, is a run of whole tokens of the normalized ``answer``.

    >>> contains_answer("It is 1,214 metres high.", ["1,214 metres", "1214"])
    True
    >>> contains_answer("UDP port 47810", ["4", "four"])
    False
    >>> contains_answer("", ["Port Tessaly"])
    False
    """
    tokens = normalize(answer)
    return any(_contains(tokens, normalize(g)) for g in golds)


def token_f1(prediction: str, gold: str) -> float:
    """SQuAD token F1 between two texts after :func:`normalize` (1.0 when both are empty).

    >>> token_f1("Port Tessaly", "port tessaly")
    1.0
    >>> round(token_f1("the capital is Port Tessaly", "Port Tessaly"), 3)
    0.667
    >>> token_f1("Sable Harbour", "Port Tessaly")
    0.0
    """
    pred, ref = normalize(prediction), normalize(gold)
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def best_f1(prediction: str, golds: Sequence[str]) -> float:
    """The best :func:`token_f1` of ``prediction`` over the gold aliases (0.0 without any).

    >>> best_f1("1214", ["1,214 metres", "1214"])
    1.0
    """
    return max((token_f1(prediction, g) for g in golds), default=0.0)
