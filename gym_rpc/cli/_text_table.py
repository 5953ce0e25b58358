"""A plain text table for the CLI, with the little of rich's Table the status table uses (no dependency).

Columns are separated by two spaces, each as wide as its widest cell, no trailing spaces, never wrapped (scripts
split lines on runs of spaces). A cell may be marked `[green]text[/]`: with colour on, the text is shown in that
colour (ANSI SGR codes), without it the mark is dropped. The header is bold with colour on.
"""

from __future__ import annotations

import re

_MARK = re.compile(r"\[(\w+)\](.*)\[/\]\Z", re.S)
_ANSI = {"bold": "1", "red": "31", "green": "32", "yellow": "33"}
_RESET = "\x1b[0m"


def _styled(text: str, style: str, color: bool) -> str:
    return f"\x1b[{_ANSI[style]}m{text}{_RESET}" if color and style in _ANSI else text


class Table:
    """Columns, then rows of one text per column; `render` joins them into lines."""

    def __init__(self) -> None:
        self._columns: list[str] = []
        self._rows: list[list[tuple[str, str]]] = []  # (plain text, style) per cell

    def add_column(self, header: str) -> None:
        self._columns.append(header)

    def add_row(self, *cells: str) -> None:
        if len(cells) != len(self._columns):
            raise ValueError(f"a row of {len(cells)} cells for {len(self._columns)} columns")
        row = []
        for cell in cells:
            mark = _MARK.match(cell)
            row.append((mark.group(2), mark.group(1)) if mark else (cell, ""))
        self._rows.append(row)

    def render(self, *, color: bool = False) -> str:
        widths = [len(header) for header in self._columns]
        for row in self._rows:
            widths = [max(width, len(text)) for width, (text, _) in zip(widths, row, strict=True)]
        header = "  ".join(_styled(h.ljust(w), "bold", color) for h, w in zip(self._columns, widths, strict=True))
        lines = [header.rstrip()]
        for row in self._rows:
            cells = [
                _styled(text, style, color) + " " * (width - len(text))
                for (text, style), width in zip(row, widths, strict=True)
            ]
            lines.append("  ".join(cells).rstrip())
        return "\n".join(lines)
