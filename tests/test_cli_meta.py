"""Every command: ``--version`` names the installed package, ``--help`` loads no
torch (each stage imports it only when it runs), and pyproject's entry points resolve."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
TOOLS = {
    "edge-client": "edge_client.cli",
    "edgespec-verifier": "cloud_verifier.server",
    "edgespec-healthcheck": "cloud_verifier.healthcheck",
    "edgespec-prepare": "edge_client.tools.prepare",
    "edgespec-distill": "edge_client.tools.distill.cli",
    "edgespec-bench": "edge_client.bench.cli",
}
HEAVY = ("torch", "transformers", "onnx", "optimum")


def _python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("script", TOOLS)
def test_version_prints_the_package_version(script):
    done = _python("-m", TOOLS[script], "--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"edgespec {version('edgespec')}\n"


@pytest.mark.parametrize("script", TOOLS)
def test_help_loads_no_torch(script):
    code = (f"import sys\nfrom {TOOLS[script]} import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit as exc:\n    assert exc.code == 0\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))")
    done = _python("-c", code)
    assert done.returncode == 0, done.stderr
    assert f"usage: {script}" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_entry_points_resolve_to_a_main():
    """Every console script names a module that defines its function (read, not imported: the
    verifier's imports torch)."""
    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for name, module in TOOLS.items():
        assert scripts[name] == f"{module}:main"
    for name, target in scripts.items():
        module, _, attr = target.partition(":")
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin, name
        tree = ast.parse(Path(spec.origin).read_text())
        assert any(isinstance(n, ast.FunctionDef) and n.name == attr for n in tree.body), name
