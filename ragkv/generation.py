"""Token generation on a prepared cache: greedy or sampled, streamed, with stop strings."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from ragkv.model.threads import ADAPT_EVERY_STEPS, adapt_threads

if TYPE_CHECKING:
    from transformers.cache_utils import Cache

    from ragkv.types import ChunkKV, LogitsWanted

__all__ = [
    "Decoder",
    "GenerationConfig",
    "TextDecoder",
    "TextStream",
    "decode_loop",
    "generate_ids",
    "pick_token",
    "stream_text",
]


class Decoder(Protocol):
    """What generation runs on (``ragkv.model.ModelAdapter`` is one): no import of the model adapter here."""

    @property
    def eos_token_ids(self) -> AbstractSet[int]: ...

    def build_cache(self, context: Sequence[ChunkKV]) -> Cache: ...

    def forward(
        self, token_ids: Sequence[int] | torch.Tensor, cache: Cache, start: int, logits: LogitsWanted = "all"
    ) -> torch.Tensor: ...


class TextDecoder(Protocol):
    """What :func:`stream_text` needs: token ids to text."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True, slots=True)
class GenerationConfig:
    """How to pick answer tokens."""

    max_new_tokens: int = 128  # hard cap on answer tokens
    temperature: float = 0.0  # 0 = greedy (as is anything below 1e-30, its limit)
    top_p: float = 1.0  # nucleus sampling mass (sampling only)
    top_k: int = 0  # keep the k most likely tokens (0 = all; sampling only)
    stop: tuple[str, ...] = ()  # stop before any of these strings appears in the answer
    seed: int | None = None  # sampling seed, for reproducible answers
    ignore_eos: bool = False  # decode exactly max_new_tokens, end tokens included (benchmarks)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if not self.temperature >= 0:  # NaN too
            raise ValueError(f"temperature must be a number >= 0 (0 means greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")


_GREEDY_BELOW = 1e-30  # temperatures below this pick as greedy (the limit as the temperature goes to 0)


def _pick(logits: torch.Tensor, cfg: GenerationConfig, gen: torch.Generator | None) -> int:
    # logits: [vocab] fp32
    if cfg.temperature < _GREEDY_BELOW:  # 0, or so small that float32 would divide by 0: its limit, greedy
        return int(torch.argmax(logits))
    # the largest logit moved to 0 first: a tiny temperature then gives -inf to the others, never
    # inf (whose softmax is NaN and would fail the pick)
    logits = (logits - logits.max()) / cfg.temperature
    if cfg.top_k > 0:
        kth = torch.topk(logits, min(cfg.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if cfg.top_p < 1:
        sorted_p, idx = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < cfg.top_p  # always keeps the top token
        probs = torch.zeros_like(probs).scatter(0, idx[keep], sorted_p[keep])
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))


def pick_token(logits: torch.Tensor, cfg: GenerationConfig, gen: torch.Generator | None) -> int:
    """The next token from ``[vocab]`` logits: argmax when greedy, else sampled with ``cfg`` and ``gen``.

    The one sampling rule, shared by the answer driver (``ragkv.driver``) and :func:`decode_loop`.
    """
    return _pick(logits, cfg, gen)


def decode_loop(
    adapter: Decoder,
    cache: Cache,
    first_logits: torch.Tensor,
    start: int,
    cfg: GenerationConfig,
    *,
    step: Callable[[int], torch.Tensor] | None = None,
) -> Iterator[int]:
    """Yield answer token ids one at a time (stops at EOS or ``max_new_tokens``): the reference decode.

    No answer runs through it (every answer goes through ``ragkv.driver``); tests and benchmarks
    compare against it and decode token ids with it.

    Args:
        adapter: the model.
        cache: the prompt's cache, appended to as tokens are generated (unless ``step`` is given).
        first_logits: ``[vocab]`` logits of the prompt's last position.
        start: position of the first generated token.
        cfg: sampling settings.
        step: feeds one token and returns the next ``[vocab]`` logits (one row of a batch:
            ``ragkv.model.batch.one_row``); None runs ``adapter.forward`` on ``cache``.
    """
    gen = None
    if cfg.temperature > 0:
        gen = torch.Generator().manual_seed(cfg.seed) if cfg.seed is not None else torch.Generator()
        if cfg.seed is None:
            gen.seed()
    eos = frozenset() if cfg.ignore_eos else adapter.eos_token_ids
    logits = first_logits
    for i in range(cfg.max_new_tokens):
        if i % ADAPT_EVERY_STEPS == 0:
            adapt_threads()  # another process may have taken a core since the last look
        tok = _pick(logits, cfg, gen)
        if tok in eos:
            return
        yield tok
        if i + 1 < cfg.max_new_tokens:
            logits = step(tok) if step is not None else adapter.forward([tok], cache, start + i, logits="last")[-1]


def generate_ids(
    adapter: Decoder, context: Sequence[ChunkKV], suffix_ids: Sequence[int], max_new_tokens: int
) -> list[int]:
    """Greedy answer ids of ``suffix_ids`` on top of ``context`` (stops at EOS): a reference answer."""
    start = sum(p.num_tokens for p in context)
    cache = adapter.build_cache(context)
    logits = adapter.forward(suffix_ids, cache, start, logits="last")[-1]  # [vocab]
    cfg = GenerationConfig(max_new_tokens=max_new_tokens)
    return list(decode_loop(adapter, cache, logits, start + len(suffix_ids), cfg))


class TextStream:
    """Answer tokens to text deltas, one token at a time, holding back text that may start a stop string.

    The driver pushes each token as it is picked; :attr:`stopped` turns True at the token whose
    text completes a stop string (the answer ends there, the stop string not shown), so no step
    runs past it.
    """

    def __init__(self, adapter: TextDecoder, stop: Sequence[str] = ()) -> None:
        self._adapter, self._stop = adapter, [s for s in stop if s]
        self._hold = max((len(s) for s in stop), default=0)
        self._ids: list[int] = []
        self._emitted = ""
        self.stopped = False

    def push(self, token: int) -> str:
        """The text ``token`` adds: "" while a multi-byte character or a possible stop string is incomplete."""
        if self.stopped:
            raise RuntimeError("the answer ended at a stop string; push no more tokens")
        self._ids.append(token)
        text = self._adapter.decode(self._ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence; wait for the next token
            return ""
        cut = min((i for i in (text.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return text[len(self._emitted) : cut] if cut > len(self._emitted) else ""
        safe = len(text) - self._hold if self._hold else len(text)
        if safe <= len(self._emitted):
            return ""
        delta, self._emitted = text[len(self._emitted) : safe], text[:safe]
        return delta

    def flush(self) -> str:
        """The text held back, once the answer ended otherwise than at a stop string."""
        if self.stopped or not self._ids:
            return ""
        text = self._adapter.decode(self._ids)
        delta, self._emitted = text[len(self._emitted) :], text
        return delta


def stream_text(adapter: TextDecoder, tokens: Iterator[int], stop: Sequence[str] = ()) -> Iterator[tuple[str, int]]:
    """Turn a token stream into text deltas, holding back text that may start a stop string (a :class:`TextStream`).

    Yields ``(delta, token_id)``; a delta may be empty while a multi-byte character or a possible
    stop string is incomplete. Stops (without emitting it) at the first stop string.
    """
    text = TextStream(adapter, stop)
    for tok in tokens:
        delta = text.push(tok)
        if text.stopped:
            if delta:
                yield delta, tok
            return
        yield delta, tok
    rest = text.flush()
    if rest:
        yield rest, -1
