"""A generation's text as it comes, for ``edge-client generate`` and ``edge-client chat``.

Verified tokens are written as they commit. Unverified ones (the draft alone, draft-only
fallback) are written at once too, marked, and taken back when a verified chunk replaces
them (``Chunk.replaces``):

- on a terminal they are dim, and taking them back moves the cursor to where they began
  and clears to the end of the screen. The rows they took are counted from the terminal's
  width, because a backspace does not cross a wrapped line;
- elsewhere (a pipe, a log) nothing can be taken back, so the output is a transcript:
  `` [unverified: ...]`` as the draft proposed it, then the verified text.
"""

from __future__ import annotations

import shutil
from typing import TextIO

from edge_client.tokenizer import EdgeTokenizer, TextStream

DIM, PLAIN = "\x1b[2m", "\x1b[0m"
_TAIL = 8


class LiveText:
    def __init__(self, tokenizer: EdgeTokenizer, out: TextIO, tty: bool | None = None) -> None:
        self.tokenizer = tokenizer
        self.out = out
        self.tty = out.isatty() if tty is None else tty
        self._verified = TextStream(tokenizer)
        self._unverified: list[int] = []
        self._tail: list[int] = []  # the last verified tokens (_show_unverified)
        self._shown = ""  # the unverified text on screen (or in the open transcript bracket)
        self._col = 0  # the cursor's column before the unverified text (terminal only)
        self._width = max(1, shutil.get_terminal_size((80, 24)).columns)
        self.text = ""  # the verified text written so far

    def push(self, token_ids: list[int], verified: bool = True, replaces: int = 0) -> None:
        """One chunk (edge_client.client.Chunk's fields)."""
        if replaces:
            del self._unverified[max(0, len(self._unverified) - replaces):]
        if verified:
            self._tail = (self._tail + list(token_ids))[-_TAIL:]
            piece = self._verified.push(token_ids)
            if replaces or (piece and self._shown):
                kept = self._unverified
                self._take_back()
                self._unverified = kept
            if piece:
                self._write_verified(piece)
            if self._unverified:
                self._show_unverified()
        else:
            self._unverified.extend(token_ids)
            self._show_unverified()
        self.out.flush()

    def finish(self) -> None:
        """Ends the text (what is still unverified stays, marked) with a newline."""
        if self._shown:
            self.out.write(PLAIN if self.tty else "]")
        self.out.write("\n")
        self.out.flush()
        self._shown = ""
        self._unverified = []

    def _write_verified(self, piece: str) -> None:
        self.out.write(piece)
        self.text += piece
        self._col = _column_after(self._col, piece, self._width)

    def _show_unverified(self) -> None:
        # Decoded after the last verified tokens: a tokenizer may put the space between
        # two tokens into the later one only when it has an earlier one.
        tail = self._tail
        text = self.tokenizer.decode(tail + self._unverified)[len(self.tokenizer.decode(tail)):]
        if text == self._shown:
            return
        if self.tty:
            if self._shown:
                self._clear_back()
            self.out.write(DIM + text + PLAIN)
        elif self._shown and text.startswith(self._shown):
            self.out.write(text[len(self._shown):])
        else:
            if self._shown:
                self.out.write("]")
            self.out.write(" [unverified: " + text)
        self._shown = text

    def _take_back(self) -> None:
        if not self._shown:
            return
        if self.tty:
            self._clear_back()
        else:
            self.out.write("] ")
        self._shown = ""
        self._unverified = []

    def _clear_back(self) -> None:
        """Moves the cursor back over the unverified text on screen and clears it."""
        rows = _rows_taken(self._col, self._shown, self._width)
        if rows:
            self.out.write(f"\x1b[{rows}A")
        self.out.write("\r" + (f"\x1b[{self._col}C" if self._col else "") + "\x1b[J")


def _column_after(col: int, text: str, width: int) -> int:
    for ch in text:
        if ch == "\n":
            col = 0
        elif ch == "\r":
            col = 0
        else:
            col = 1 if col >= width else col + 1
    return col


def _rows_taken(col: int, text: str, width: int) -> int:
    """How many rows below the starting one ``text`` ends on, written from column ``col``."""
    rows = 0
    for ch in text:
        if ch in "\n\r":
            rows += ch == "\n"
            col = 0
        elif col >= width:
            rows += 1
            col = 1
        else:
            col += 1
    return rows
