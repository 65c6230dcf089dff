"""Text helpers of the report: titles, dotted rows, aligned tables, byte counts, one-line errors."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["fmt_bytes", "one_line", "rows", "section", "table", "title"]


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit} ({n:,} B)"
    return f"{n:,} B"


def one_line(exc: BaseException) -> str:
    return "; ".join(part.strip() for part in str(exc).splitlines() if part.strip()) or type(exc).__name__


def title(text: str) -> list[str]:
    return ["", text, "-" * len(text)]


def rows(items: Sequence[tuple[str, str]]) -> list[str]:
    width = max(len(k) for k, _ in items) + 2
    return [f"{k + ' ':.<{width}} {v}" for k, v in items]


def section(heading: str, items: Sequence[tuple[str, str]]) -> list[str]:
    return title(heading) + rows(items)


def table(lines: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in lines) for i in range(len(lines[0]))]
    return ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in lines]
