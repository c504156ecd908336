"""Terminal tables that never cut a number, at any width (a pipe is 80 columns).

Rich fits a table that is too wide by shrinking every column at last, numbers included (``2.75e-…``). A
:class:`Fitted` table instead gives each column its width itself, when it is printed (it knows the console's
width only then), by one rule whatever columns a report adds:

- a ``number`` column (numbers, or words that must stay whole: maths) is as wide as its widest cell: never cut,
  never wrapped;
- a ``name`` column (a dotted module path) takes what the others leave and shortens each name from the left
  (:func:`short_name`), keeping its stage (``layer.5``) and its last part;
- a ``text`` column takes what the others leave too and wraps between words (inside a word only where no
  layout leaves the word room);
- what the narrowest layout leaves goes to the column whose cells are tallest, a character at a time, so that a
  row takes as few lines as the width allows. No ``…`` is ever written into a cell but a shortened name's.

When the columns do not fit side by side with their text unwrapped, the table is drawn without its vertical rules;
if that does not fit, text wraps between words, then a word too long for its column breaks after a ``_`` or before
a ``.`` (never inside a number), and a number column's header wraps between its words (``x`` / ``fp32``); a
``key`` column (a level, an output) is never folded inside a word: before that, the table is split into several,
each repeating the ``key`` columns (which tell rows apart). A pair that must read as one (``19.5/156``) is one
token.

Example:

    >>> from rich.console import Console
    >>> table = Fitted("errors", [Column("layer", "name", key=True), Column("normwise"), Column("max abs")])
    >>> table.add_row("encoder.layer.5.attention.output.dense", "2.75e-04", "1.17e-03")
    >>> console = Console(width=40, color_system=None)
    >>> with console.capture() as captured:
    ...     console.print(table)
    >>> "2.75e-04" in captured.get() and "1.17e-03" in captured.get()   # numbers whole
    True
    >>> "…layer.5.…dense" in captured.get()   # the name shortened from the left, its stage kept
    True
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from rich import box
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions
from rich.table import Table
from rich.text import Text

Kind = Literal["number", "name", "text"]
NAME_MIN = 16  # a module path shorter than this says too little ("…dense")
TEXT_MIN = 6  # a wrapped text column narrower than this is mostly line breaks
_MEASURE = Console(width=10_000, color_system=None)  # wraps text to count its lines; never prints


# a word: what whitespace separates, but a pair ``19.5 / 156`` is one (its halves belong together)
_WORD = re.compile(r"\S+(?: / \S+)*")
# where a word longer than its column breaks: after ``_``, and after a ``.`` before a letter (a module path's
# parts; never inside a number such as 2.75e-04)
_BREAK = re.compile(r"(?<=_)|(?<=\.)(?=[A-Za-z])")


def _pieces(word: str) -> list[str]:
    return [piece for piece in _BREAK.split(word) if piece]


@functools.lru_cache(maxsize=4096)
def _wrap(text: str, width: int) -> tuple[tuple[int, int], ...]:
    """Where ``text`` breaks into lines at ``width``: between words; a word too long for any line at its ``_``
    and ``.`` boundaries, inside a piece only where a piece itself is too long. Each line as (start, end)."""
    spans: list[tuple[int, int]] = []
    offset = 0
    for paragraph in text.split("\n"):
        line: Optional[list[int]] = None
        for match in _WORD.finditer(paragraph):
            start, end = match.start() + offset, match.end() + offset
            if line is not None and cell_len(text[line[0]:end]) <= width:
                line[1] = end
                continue
            if line is not None:
                spans.append((line[0], line[1]))
                line = None
            if cell_len(match.group()) <= width:
                line = [start, end]
                continue
            at = start
            for piece in _pieces(match.group()):
                first, at = at, at + len(piece)
                if line is not None and cell_len(text[line[0]:at]) <= width:
                    line[1] = at
                    continue
                if line is not None:
                    spans.append((line[0], line[1]))
                while cell_len(text[first:at]) > width:  # a piece longer than the column: folded
                    cut = first + max(width, 1)
                    spans.append((first, cut))
                    first = cut
                line = [first, at]
        spans.append((line[0], line[1]) if line is not None else (offset, offset))
        offset += len(paragraph) + 1
    return tuple(spans)


def _lines(text: str, width: int) -> int:
    return len(_wrap(text, width))


def short_name(name: str, width: int = 36) -> str:
    """A dotted module name cut from the left to at most ``width`` characters, keeping its stage (the last index
    with the part before it, ``layer.5``) and its last part, which tell layers apart.

    Example:

        >>> short_name("bert.encoder.layer.5.attention.output.dense", 36)
        '…layer.5.attention.output.dense'
        >>> short_name("bert.encoder.layer.5.attention.output.dense", 20)
        '…layer.5.…dense'
        >>> short_name("vision.features.6", 36)
        'vision.features.6'
        >>> short_name("head_projection_with_a_long_name.bias", 24)
        '…n_with_a_long_name.bias'
    """
    if cell_len(name) <= width:
        return name
    parts = name.split(".")
    stage = max((i for i, part in enumerate(parts) if part.isdigit()), default=None)
    # whole parts dropped from the left, as long as the stage stays and half the width is still used (else one
    # long part, ``head_projection.bias``, would leave ``…bias``)
    for start in range(1, len(parts) if stage is None else stage + 1):
        shown = "…" + ".".join(parts[start:])
        if cell_len(shown) <= width:
            if stage is not None or 2 * cell_len(shown) >= width:
                return shown
            break
    if stage is not None and stage < len(parts) - 1:
        # the stage kept, then parts between it and the end dropped (the last part stays)
        for first in (max(stage - 1, 0), stage):
            head = ("…" if first > 0 else "") + ".".join(parts[first:stage + 1])
            for start in range(stage + 2, len(parts)):
                shown = f"{head}.…{'.'.join(parts[start:])}"
                if cell_len(shown) <= width:
                    return shown
    tail = name[-max(width - 1, 1):]
    cut = tail.find(".")  # from a part's start, unless that gives away more than half
    return "…" + (tail[cut + 1:] if 0 <= cut < len(tail) // 2 else tail)


@dataclass(frozen=True)
class Column:
    """One column of a :class:`Fitted` table. ``kind``: ``"number"`` (whole, never wrapped), ``"name"`` (a module
    path, shortened from the left) or ``"text"`` (wraps); ``key``: repeated in every part of a split table (a key
    is never cut or wrapped either); ``justify``: default right for numbers, left for the others."""

    header: str
    kind: Kind = "number"
    key: bool = False
    justify: Optional[Literal["left", "right", "center"]] = None


def _plain(cell: Any) -> str:
    return cell.plain if isinstance(cell, Text) else str(cell)


def _longest_word(text: str, pieces: bool = False) -> int:
    """The widest word (a pair ``a / b`` is one); with ``pieces``, the widest piece of one (``classification_``)."""
    return max((cell_len(piece) for word in _WORD.findall(text) for piece in (_pieces(word) if pieces else [word])),
               default=0)


_LAYOUTS = ("boxed", "open")


def _table(layout: str, **kwargs: Any) -> Table:
    if layout == "boxed":
        return Table(**kwargs)
    # no vertical rules, one space of padding: columns 2 apart rather than 3, no edges
    return Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0), **kwargs)


@functools.cache
def _overhead(layout: str, columns: int) -> int:
    """What a table of ``layout`` spends besides its columns' contents (rules, padding), measured from rich itself
    rather than assumed."""
    table = _table(layout)
    for _ in range(columns):
        table.add_column(width=1, no_wrap=True)
    table.add_row(*["x"] * columns)
    return max(cell_len(line) for line in _MEASURE.render_lines(table, pad=False)
               for line in ["".join(segment.text for segment in line)]) - columns


class Fitted:
    """A table whose numbers are never cut: see the module docstring for the rule. ``rich`` renders it at the
    console's width (``console.print(table)``); :meth:`tables` gives the tables for a width."""

    def __init__(self, title: Optional[str] = None, columns: Sequence[Column] = (), *,
                 caption: Optional[str] = None) -> None:
        self.title, self.caption = title, caption
        self.columns: list[Column] = list(columns)
        self.rows: list[tuple[Any, ...]] = []

    def add_column(self, column: Column) -> None:
        self.columns.append(column)

    def add_row(self, *cells: Any) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"a row of {len(cells)} cells in a table of {len(self.columns)} columns")
        self.rows.append(cells)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[Union[Table, Text]]:
        for table in self.tables(options.max_width):
            # the title above the table, wrapped at the terminal's width: rich wraps it at the table's, and a
            # narrow table broke it mid-phrase ("(7 of" / "7)")
            title, table.title = table.title, None
            caption, table.caption = table.caption, None
            if title:
                yield Text(title, style="table.title", justify="left")
            yield table
            if caption:  # and its caption below it, likewise
                yield Text(caption, style="table.caption", justify="left")

    # -- widths ----------------------------------------------------------------------------------------------------
    def _natural(self, i: int) -> int:
        return max([cell_len(self.columns[i].header), *(cell_len(_plain(row[i])) for row in self.rows)])

    def _least(self, i: int, wrap: int = 2) -> int:
        """The narrowest column ``i`` can be: its widest cell for a number (its header wrapped between words
        where text may ``wrap``), or for text that may not ``wrap`` (0); a floor for names; for text, its longest
        word (``wrap`` 1: between words, or at a long word's ``_`` and ``.``) or a floor (2: a word longer than
        the column folds, the last resort before a split; never in a key, which tells rows apart, unless 3: no
        layout fits)."""
        column, natural = self.columns[i], self._natural(i)
        if column.kind == "number" and wrap:
            return max([_longest_word(column.header), *(cell_len(_plain(row[i])) for row in self.rows)])
        if column.kind == "number" or (column.kind == "text" and not wrap):
            return natural
        floor = max(NAME_MIN if column.kind == "name" else TEXT_MIN, _longest_word(column.header))
        if column.kind == "text" and (wrap == 1 or (wrap == 2 and column.key)):
            # between words, never inside one (a number in it stays whole, a level's name too); a key's long
            # word (an output's name) at its `_` and `.` rather than anywhere
            floor = max([floor, *(_longest_word(_plain(row[i]), pieces=wrap == 2) for row in self.rows)])
        return min(natural, floor)

    def _widths(self, shown: Sequence[int], width: int, layout: str, wrap: int = 1) -> Optional[dict[int, int]]:
        """The width of each shown column when they fit ``width`` side by side in ``layout`` (text wrapped only
        where it may ``wrap``), else None."""
        room = width - _overhead(layout, len(shown))
        widths = {i: self._least(i, wrap) for i in shown}
        if sum(widths.values()) > room:
            return None
        # what is left goes to the tallest column (wrapped text, then shortened names), as much as it needs to
        # lose a line, the cheapest first: the rows come out as few lines high as the width allows
        left = room - sum(widths.values())
        while left > 0:
            options = []
            for i in shown:
                need = self._need(i, widths[i])
                if need is not None and need <= left:
                    options.append((-self._height(i, widths[i]), need, i))
            if not options:
                break
            _, need, i = min(options)
            widths[i] += need
            left -= need
        return widths

    def _need(self, i: int, width: int) -> Optional[int]:
        """How many more columns column ``i`` needs to get shorter (None: it is as short as it gets)."""
        natural = self._natural(i)
        if width >= natural:
            return None
        if self.columns[i].kind == "name":
            return 1
        now = self._height(i, width)
        return next(w for w in range(width + 1, natural + 1) if self._height(i, w) < now or w == natural) - width

    def _height(self, i: int, width: int) -> float:
        """How tall column ``i``'s cells are at ``width``: the most lines a text cell wraps onto; for names, how
        much of the longest is kept out (a fraction of a line, so wrapped text comes first)."""
        if self.columns[i].kind == "name":
            return 1 + (1 - width / self._natural(i)) / 2
        return max([_lines(self.columns[i].header, width), *(_lines(_plain(row[i]), width) for row in self.rows)])

    def _parts(self, width: int) -> tuple[str, list[dict[int, int]]]:
        everything = list(range(len(self.columns)))
        # unwrapped text in either layout first, then text wrapped between words, then folded, then the split
        for wrap, layout in ((0, "boxed"), (0, "open"), (1, "boxed"), (1, "open"), (2, "open")):
            widths = self._widths(everything, width, layout, wrap)
            if widths is not None:
                return layout, [widths]
        for layout in _LAYOUTS:
            parts = self._split(width, layout)
            if all(parts):
                return layout, parts
        # a part that fits at no width (one below a number's) is still printed: its cells fold, never an ellipsis
        return _LAYOUTS[-1], [part or {i: self._least(i, 3) for i in shown}
                              for part, shown in zip(parts, self._split(width, _LAYOUTS[-1], columns=True))]

    def _split(self, width: int, layout: str, columns: bool = False) -> list[Any]:
        """The keys in every part, the other columns in their order, as many as fit beside them: each part's widths
        (empty where it fits nowhere) or, with ``columns``, its columns."""
        keys = [i for i, column in enumerate(self.columns) if column.key]
        groups: list[list[int]] = [[]]
        for i, column in enumerate(self.columns):
            if column.key:
                continue
            if groups[-1] and self._widths(sorted({*keys, *groups[-1], i}), width, layout) is None:
                groups.append([])
            groups[-1].append(i)
        shown = [sorted({*keys, *group}) for group in groups]
        return shown if columns else [self._widths(part, width, layout, 2) or {} for part in shown]

    def tables(self, width: int) -> list[Table]:
        """The rich tables that show this one at ``width`` columns: one, or several each repeating the keys."""
        layout, parts = self._parts(width)
        tables = []
        for n, widths in enumerate(parts):
            title = self.title if n == 0 else (f"{self.title} (continued)" if self.title else None)
            table = _table(layout, title=title, title_justify="left",
                           caption=self.caption if n == len(parts) - 1 else None, caption_justify="left")
            for i, w in widths.items():
                column = self.columns[i]
                numeric = column.kind == "number"
                table.add_column(column.header, justify=column.justify or ("right" if numeric else "left"),
                                 width=w, overflow="fold")
            for row in self.rows:
                table.add_row(*(self._cell(row[i], self.columns[i], w) for i, w in widths.items()))
            tables.append(table)
        return tables

    @staticmethod
    def _cell(cell: Any, column: Column, width: int) -> Any:
        text = _plain(cell)
        if column.kind != "name":
            # broken where it was measured (rich would break only at spaces, and fold a long word anywhere)
            spans = _wrap(text, width)
            if len(spans) == 1 or column.kind == "number":
                return cell
            if isinstance(cell, Text):
                return Text("\n").join(cell[start:end] for start, end in spans)
            return "\n".join(text[start:end] for start, end in spans)
        shown = short_name(text, width)
        if shown == text:
            return cell
        return Text(shown, style=cell.style) if isinstance(cell, Text) else shown


def as_lines(renderable: Any, width: Optional[int] = None) -> list[str]:
    """``renderable`` (a :class:`Fitted` table) as plain lines at ``width`` columns (None: the terminal's, 80
    when it is a pipe), trailing spaces dropped: for summaries that are lists of lines.

    Example:

        >>> table = Fitted(None, [Column("candidate", "text"), Column("speedup")])
        >>> table.add_row("pin encoder.layer.5.attention.output.dense and two more", "1.42x")
        >>> lines = as_lines(table, 40)
        >>> any(line.endswith("  1.42x") for line in lines), max(map(len, lines)) <= 40
        (True, True)
    """
    console = Console(width=width, color_system=None, highlight=False, emoji=False, markup=False)
    with console.capture() as captured:
        console.print(renderable)
    return [line.rstrip() for line in captured.get().splitlines()]

