"""The size rule of the project's engineering standards: no Python module over 600 lines, so
that each keeps one job (tests and offline tools included; generated protobuf code excepted)."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 600
PACKAGES = ("edge_client", "cloud_verifier", "shared", "tests", "deploy", "proto")
GENERATED = (REPO_ROOT / "shared" / "pb",)


def modules() -> list[Path]:
    found = []
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            if not any(path.is_relative_to(g) for g in GENERATED):
                found.append(path)
    return found


def test_no_module_is_over_the_line_limit():
    paths = modules()
    assert len(paths) > 100, "the walk found too few modules to be the project's"
    long = {str(p.relative_to(REPO_ROOT)): n for p in paths
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}, f"over {MAX_LINES} lines: {long}"
