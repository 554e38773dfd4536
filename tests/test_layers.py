"""The import rules between the layers, each checked in a fresh interpreter.

- The device runtime (``edge_client`` but its ``bench`` and ``tools`` subpackages) loads
  neither torch nor transformers nor any ``cloud_verifier`` module.
- ``shared`` loads no torch: both sides use it.
- The verifier's runtime (``cloud_verifier`` but ``cloud_verifier.bench``) loads no
  ``edge_client`` module.
- Finding the shipped draft is not an import dependency: ``shared.paths`` locates
  ``edge_client/drafts`` from its own file, without importing ``edge_client``.

Importing a module only runs its top level; a function may import more when it runs. So the
same rules are also checked on the source: no ``import`` statement anywhere in a runtime
module (inside functions too) reaches across.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

# Imports every module of a package, recursively, except the skipped subpackages (which are
# never imported, not even their __init__), and prints them with every module then loaded.
WALK = """
import importlib, json, pkgutil, sys

def walk(name, skip):
    pkg = importlib.import_module(name)
    names = [name]
    for info in pkgutil.iter_modules(pkg.__path__, name + "."):
        if info.name in skip:
            continue
        if info.ispkg:
            names += walk(info.name, skip)
        else:
            importlib.import_module(info.name)
            names.append(info.name)
    return names

names = walk(sys.argv[1], set(sys.argv[2:]))
print(json.dumps({"imported": names, "loaded": sorted(sys.modules)}))
"""

RUNTIME = {
    "edge_client": ("edge_client.bench", "edge_client.tools"),
    "shared": (),
    "cloud_verifier": ("cloud_verifier.bench",),
}
FORBIDDEN = {
    "edge_client": ("torch", "transformers", "cloud_verifier"),
    "shared": ("torch",),
    "cloud_verifier": ("edge_client",),
}


def _walk(package: str) -> dict:
    done = subprocess.run([sys.executable, "-c", WALK, package, *RUNTIME[package]],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _offending(loaded: list[str], roots: tuple[str, ...]) -> list[str]:
    return [m for m in loaded if m.split(".")[0] in roots]


@pytest.mark.parametrize("package", list(RUNTIME))
def test_runtime_modules_load_nothing_across_the_layers(package):
    result = _walk(package)
    assert len(result["imported"]) > 1
    assert not [m for m in result["imported"]
                if m.startswith(tuple(s + "." for s in RUNTIME[package]))]
    bad = _offending(result["loaded"], FORBIDDEN[package])
    assert not bad, f"importing the {package} runtime loads {bad[:20]}"


def _runtime_files(package: str) -> list[Path]:
    skipped = [REPO_ROOT / Path(*s.split(".")) for s in RUNTIME[package]]
    return [p for p in sorted((REPO_ROOT / package).rglob("*.py"))
            if not any(p.is_relative_to(s) for s in skipped)
            and not p.is_relative_to(REPO_ROOT / "shared" / "pb")]


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package", list(RUNTIME))
def test_no_runtime_source_imports_across_the_layers(package):
    files = _runtime_files(package)
    assert files
    bad = {str(p.relative_to(REPO_ROOT)): sorted(_imported_roots(p) & set(FORBIDDEN[package]))
           for p in files}
    assert not {k: v for k, v in bad.items() if v}


def test_the_shipped_draft_is_found_without_importing_edge_client():
    code = ("import json, sys\nfrom shared.paths import default_draft_dir\n"
            "d = default_draft_dir()\n"
            "print(json.dumps({'dir': str(d), 'loaded': sorted(sys.modules)}))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert (Path(result["dir"]) / "model.onnx").is_file()
    assert Path(result["dir"]).is_relative_to(REPO_ROOT / "edge_client" / "drafts")
    assert not _offending(result["loaded"], ("edge_client", "cloud_verifier", "torch"))
