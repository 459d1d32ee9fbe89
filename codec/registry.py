"""Codec registry: names to codec classes, no if-ladders."""

from __future__ import annotations

from ragkv.codec.base import Codec

__all__ = ["register_codec", "get_codec", "available_codecs"]

_CODECS: dict[str, Codec] = {}


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Make a codec class available by its ``name``; usable as a class decorator.

    Raises:
        TypeError: ``cls`` is not a concrete :class:`Codec` subclass.
        ValueError: another class is registered under the same name, or ``levels`` is empty.
    """
    if not (isinstance(cls, type) and issubclass(cls, Codec)):
        raise TypeError(f"register_codec expects a Codec subclass; got {cls!r}")
    name = getattr(cls, "name", "")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{cls.__name__} must set a non-empty class attribute `name`")
    levels = getattr(cls, "levels", ())
    if not levels or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in levels):
        raise ValueError(f"{cls.__name__} must list its levels, ints >= 0, e.g. levels = (0,)")
    current = _CODECS.get(name)
    if current is not None and type(current) is not cls:
        raise ValueError(f"codec name {name!r} is already taken by {type(current).__name__}")
    _CODECS[name] = cls()
    return cls


def get_codec(name: str) -> Codec:
    """The registered codec called ``name``.

    Raises:
        ValueError: no codec has that name (the message lists those that exist).
    """
    try:
        return _CODECS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; available: {sorted(_CODECS)}") from None


def available_codecs() -> dict[str, tuple[int, ...]]:
    """Every registered codec's name and its quality levels."""
    return {name: codec.levels for name, codec in sorted(_CODECS.items())}
