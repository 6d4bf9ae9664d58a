"""One Markdown table renderer: for the CLI's reports, the benchmarks' printed results and
docs/benchmarks.md (Markdown that also reads as plain text)."""

from __future__ import annotations

from collections.abc import Sequence


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]],
                   align: str = "") -> str:
    """A Markdown table, its columns padded to one width so that it also reads as plain text.

    ``align`` holds one letter per column, ``l`` or ``r`` (numbers); columns it does not
    reach are left-aligned. Every row must have one cell per header: a short row would shift
    the cells after it under the wrong heading."""
    cells = [[str(cell) for cell in row] for row in rows]
    for row in cells:
        if len(row) != len(headers):
            raise ValueError(f"a row of {len(row)} cells under {len(headers)} headers: {row}")
    if set(align) - {"l", "r"} or len(align) > len(headers):
        raise ValueError(f"align {align!r}: one of l or r per column, at most {len(headers)}")
    widths = [max(3, len(header), *(len(row[i]) for row in cells))
              for i, header in enumerate(headers)]
    right = [i < len(align) and align[i] == "r" for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        return "| " + " | ".join(value.rjust(width) if is_right else value.ljust(width)
                                 for value, width, is_right in zip(values, widths, right,
                                                                   strict=True)) + " |"

    rule = "|" + "|".join("-" * (width + 1) + (":" if is_right else "-")
                          for width, is_right in zip(widths, right, strict=True)) + "|"
    return "\n".join([line(list(headers)), rule, *(line(row) for row in cells)])
