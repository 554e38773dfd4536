"""Publishing a directory all at once: build it beside its final place, then rename.

Every stage that writes model files uses this, so a directory that exists is a complete one
and an interrupted run leaves nothing half written behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def staging_dir(final: Path) -> Iterator[Path]:
    """Yields an empty sibling directory of ``final``; renames it to ``final`` on success."""
    final.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))
    staged.chmod(0o755)  # mkdtemp makes it private; the published directory should not be
    try:
        yield staged
        for f in staged.rglob("*"):
            if f.is_file():  # safetensors writes 0600; a shared cache should be readable
                f.chmod(f.stat().st_mode | 0o444)
        if final.exists():
            trash = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, trash)
            os.replace(staged, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(staged, final)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
