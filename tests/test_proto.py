"""The committed generated code in shared/pb is exactly what proto/generate.py produces."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_regenerating_protobuf_code_changes_nothing():
    out = subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py"), "--check"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_every_message_field_is_documented():
    """Each field in the .proto has a comment above it or at its end of line."""
    text = (ROOT / "proto" / "edgespec" / "v1" / "verifier.proto").read_text().splitlines()
    undocumented = []
    for i, line in enumerate(text):
        stripped = line.strip()
        is_field = stripped.endswith(";") and "=" in stripped and not stripped.startswith(
            ("//", "syntax", "package", "option"))
        if is_field and not text[i - 1].strip().startswith("//") \
                and "//" not in line:
            undocumented.append(stripped)
    assert not undocumented, undocumented


def test_continue_stream_ends_where_both_ends_of_the_wire_agree():
    from shared.continue_stream import ends_stream
    from shared.pb import verifier_pb2 as pb

    until_drafting = pb.ContinueRequest(max_tokens=8, stop_when_drafting_pays=True)
    to_the_end = pb.ContinueRequest(max_tokens=8)
    decoding = pb.RoundResult(suggested_draft_len=0)
    drafting_pays = pb.RoundResult(suggested_draft_len=2)
    finished = pb.RoundResult(finished=True, suggested_draft_len=0)
    assert not ends_stream(until_drafting, decoding)
    assert ends_stream(until_drafting, drafting_pays)
    assert not ends_stream(to_the_end, drafting_pays)  # the client did not ask to stop
    assert ends_stream(to_the_end, finished) and ends_stream(until_drafting, finished)
