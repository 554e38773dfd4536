"""The committed generated code in shared/pb is exactly what proto/generate.py produces."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_a_decode_ends_where_both_ends_of_the_wire_agree():
    from shared.decode_rule import ends_decode
    from shared.pb import verifier_pb2 as pb

    until_drafting = pb.Decode(round=4, max_tokens=8, stop_when_drafting_pays=True)
    to_the_end = pb.Decode(round=4, max_tokens=8)
    decoding = pb.Step(round=5, suggested_draft_len=0)
    drafting_pays = pb.Step(round=5, suggested_draft_len=2)
    no_suggestion = pb.Step(round=5)
    finished = pb.Step(round=5, finished=True, suggested_draft_len=0)
    assert not ends_decode(until_drafting, decoding)
    assert not ends_decode(until_drafting, no_suggestion)
    assert ends_decode(until_drafting, drafting_pays)
    assert not ends_decode(to_the_end, drafting_pays)  # the client did not ask to stop
    assert ends_decode(to_the_end, finished) and ends_decode(until_drafting, finished)
    # Rounds 4..11 are the Decode's 8: the 8th ends it, whatever it suggests.
    assert not ends_decode(to_the_end, pb.Step(round=10))
    assert ends_decode(to_the_end, pb.Step(round=11))
    assert ends_decode(pb.Decode(round=4, max_tokens=1), pb.Step(round=4))


def test_buf_lint_is_clean():
    """The proto passes ``buf lint`` (proto/buf.yaml); skipped where buf is not installed."""
    buf = shutil.which("buf")
    if buf is None:
        if os.environ.get("CI"):  # .ci/run installs it: never skip there
            pytest.fail("buf is not on PATH")
        pytest.skip("buf is not on PATH")
    out = subprocess.run([buf, "lint"], cwd=ROOT / "proto", capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
