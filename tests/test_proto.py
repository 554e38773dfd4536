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
