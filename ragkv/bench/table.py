"""The one table formatter of the benchmarks: rows of dicts in, a Markdown table that lines up as text out.

Every bench prints its rows with :func:`format_table` and, where the raw keys or values would read
badly, a tuple of :class:`Column` naming what each column shows and how. Tables are pasted into
docs/benchmarks.md as they are, so the output is valid Markdown and aligned in a terminal.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from numbers import Number
from typing import Any

__all__ = ["Column", "format_table", "machine_note"]


@dataclass(frozen=True, slots=True)
class Column:
    """One column of a benchmark table."""

    key: str  # the row key whose value the column shows
    header: str = ""  # the column title; the key when empty
    fmt: str = "{}"  # str.format template for a value: "{:,.0f}", "{:.1f}x"

    @property
    def title(self) -> str:
        """The header shown: ``header`` or, when empty, ``key``."""
        return self.header or self.key


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[Column | str] = ()) -> str:
    """``rows`` as a Markdown table, padded so that it also lines up as plain text.

    Columns whose values are all numbers are right-aligned (their rule reads ``---:``), the others
    left-aligned. A key missing from a row leaves its cell empty.

    Args:
        rows: one mapping per table row.
        columns: what to show, in order: a :class:`Column`, or a bare key shown with ``str()``.
            Empty: every key of the first row, in its order.

    Returns:
        The table, lines joined by ``\\n`` with no trailing newline; ``""`` when there are no rows.

    >>> print(format_table([{"tier": "memory://", "mb_s": 1.5}, {"tier": "x", "mb_s": 10.0}]))
    | tier      | mb_s |
    |-----------|-----:|
    | memory:// |  1.5 |
    | x         | 10.0 |
    >>> print(format_table([{"speedup": 3.14159}], [Column("speedup", "vs prefill", "{:.1f}x")]))
    | vs prefill |
    |-----------:|
    |       3.1x |
    """
    if not rows:
        return ""
    cols = [c if isinstance(c, Column) else Column(c) for c in columns or list(rows[0])]
    cells = [[_cell(row, c) for c in cols] for row in rows]
    widths = [max(len(c.title), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]
    right = [_numeric(rows, c.key) for c in cols]

    def line(values: Sequence[str]) -> str:
        padded = (v.rjust(w) if r else v.ljust(w) for v, w, r in zip(values, widths, right, strict=True))
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join("-" * (w + 1) + ":" if r else "-" * (w + 2) for w, r in zip(widths, right, strict=True))
    return "\n".join([line([c.title for c in cols]), rule + "|", *(line(r) for r in cells)])


def _cell(row: Mapping[str, Any], column: Column) -> str:
    if column.key not in row:
        return ""
    try:
        return column.fmt.format(row[column.key])
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"column {column.key!r}: format {column.fmt!r} does not fit the value {row[column.key]!r}; "
            "give the column a format that fits every row's value"
        ) from e


def _numeric(rows: Sequence[Mapping[str, Any]], key: str) -> bool:
    values = [row[key] for row in rows if key in row]
    return bool(values) and all(isinstance(v, Number) and not isinstance(v, bool) for v in values)


def machine_note(model: str, dtype: str, dtype_reason: str) -> str:
    """The line printed above every bench table: the model, its dtype and why, and the CPU that ran it.

    bf16 runs ~2x faster than fp32 on a CPU with native bf16 matmuls, so a figure means little
    without the dtype and the CPU's flags beside it.
    """
    import os
    from pathlib import Path

    cpu, flags = "unknown CPU", list[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == "unknown CPU":
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1].split()
    except OSError:
        pass
    shown = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    return (
        f"model {model}, dtype {dtype} ({dtype_reason}); {cpu}, {os.cpu_count()} cores, "
        f"flags: {' '.join(shown) or 'none of avx2/avx512'}"
    )
