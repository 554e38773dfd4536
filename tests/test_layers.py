"""The import rules between the layers.

The rules are import-linter contracts in pyproject.toml (``[tool.importlinter]``), checked
on the source, every import statement included (inside functions and under TYPE_CHECKING
too) and chains through other modules:

- The device runtime (``edge_client`` but its ``bench`` and ``tools`` subpackages) imports
  neither torch nor transformers nor any ``cloud_verifier`` module.
- ``shared`` imports neither side, nor torch nor transformers: both sides use it.
- The verifier's runtime (``cloud_verifier`` but ``cloud_verifier.bench``) imports no
  ``edge_client`` module.
- The runtimes import no benchmark and no offline tool.
- No cycles between the siblings of any package; and, here, no import cycle between any
  two modules of the three packages.

What the source cannot show is what an external package loads when it is imported (one
that pulls in torch, say): so the runtimes are also imported, in a fresh interpreter, and
what got loaded is checked. Finding the shipped draft is not an import dependency:
``shared.paths`` locates ``edge_client/drafts`` from its own file, without importing
``edge_client``.
"""

from __future__ import annotations

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


def test_the_import_contracts_are_kept():
    """``lint-imports`` (run from the repository root, so it reads this checkout)."""
    code = ("import sys\nfrom importlinter.cli import lint_imports\n"
            "sys.exit(lint_imports(no_cache=True, no_logo=True))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


CYCLES = """
import json, sys
import grimp

graph = grimp.build_graph(*sys.argv[1:], cache_dir=None)
print(json.dumps({m: sorted(graph.find_modules_directly_imported_by(m))
                  for m in graph.modules}))
"""


def _cycles(imports: dict[str, list[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(imports):
        if root in index:
            continue
        work = [(root, iter(imports[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in imports:
                    continue
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(imports[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycles_finds_a_circle():
    assert _cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert _cycles({"a": ["b"], "b": [], "c": ["a", "b"]}) == []


def test_no_import_cycles_between_modules():
    """grimp's graph (import-linter's), every import included: across the three packages
    too, which no single package's acyclic_siblings contract covers."""
    done = subprocess.run([sys.executable, "-c", CYCLES, *RUNTIME], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    imports = json.loads(done.stdout)
    assert "edge_client.document" in imports and "cloud_verifier.rounds" in imports
    assert _cycles(imports) == []


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
