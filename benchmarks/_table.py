"""A plain-text table printer for benchmark results (right-aligned numbers, left-aligned text)."""

from __future__ import annotations

from collections.abc import Sequence


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns sized to their widest cell; numbers right-aligned, everything else left-aligned."""
    cells = [[str(cell) for cell in row] for row in rows]
    widths = [max([len(header)] + [len(row[i]) for row in cells]) for i, header in enumerate(headers)]
    numeric = [
        all(isinstance(row[i], (int, float)) for row in rows) if rows else False for i in range(len(headers))
    ]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            value.rjust(width) if is_number else value.ljust(width)
            for value, width, is_number in zip(values, widths, numeric, strict=True)
        ).rstrip()

    rule = "  ".join("-" * width for width in widths)
    return "\n".join([line(list(headers)), rule, *(line(row) for row in cells)])
