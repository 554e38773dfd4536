"""edge_client.live_text on a terminal: unverified text is dim, and taking it back moves the
cursor up over the rows it took (counted from the terminal's width), then clears."""

from __future__ import annotations

from edge_client.live_text import DIM, PLAIN, LiveText
from edge_client.tokenizer import EdgeTokenizer


class Screen:
    def __init__(self) -> None:
        self.parts: list[str] = []

    def write(self, s: str) -> None:
        self.parts.append(s)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return True


def test_unverified_text_is_dim_and_taken_back_across_a_wrapped_line(tiny_llama_pair,
                                                                      monkeypatch):
    monkeypatch.setenv("COLUMNS", "10")  # shutil.get_terminal_size reads it first
    tok = EdgeTokenizer(tiny_llama_pair.draft_dir)
    out = Screen()
    live = LiveText(tok, out)
    live.push([5])  # "t5": the cursor at column 2
    live.push([6, 7, 8, 9], verified=False)  # " t6 t7 t8 t9": 12 columns from 2, one wrap
    assert out.parts[-1] == DIM + " t6 t7 t8 t9" + PLAIN
    out.parts.clear()
    live.push([6, 3], verified=True, replaces=4)
    # One row up, back to column 2, clear to the end of the screen, then the verified text.
    assert "".join(out.parts) == "\x1b[1A\r\x1b[2C\x1b[J t6 t3"
    assert live.text == "t5 t6 t3"
