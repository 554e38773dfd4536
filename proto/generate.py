"""Regenerates the committed Python protobuf/gRPC code in ``shared/pb`` from ``proto/``.

Generated code is committed so that the edge client installs without grpcio-tools.
``python proto/generate.py --check`` exits non-zero when the committed code is stale;
the test suite runs that check. The output depends on the grpcio-tools version, which is
pinned in the ``dev`` extra.
"""

from __future__ import annotations

import argparse
import filecmp
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
OUT = ROOT / "shared" / "pb"
PROTOS = ["edgespec/v1/verifier.proto"]
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out: Path) -> None:
    from grpc_tools import protoc

    include = Path(protoc.__file__).parent / "_proto"
    for proto in PROTOS:
        rc = protoc.main([
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            str(PROTO_ROOT / proto),
        ])
        if rc != 0:
            raise SystemExit(f"protoc failed on {proto} (exit {rc})")
    # protoc mirrors the proto path (edgespec/v1/...) and writes absolute imports of it;
    # flatten into one package and make the imports relative so it lives inside shared.pb.
    for path in list(out.rglob("*.py")) + list(out.rglob("*.pyi")):
        if path.parent != out:
            target = out / path.name
            path.replace(target)
            path = target
        text = re.sub(r"^from edgespec\.v1 import (\w+)", r"from . import \1", path.read_text(),
                      flags=re.MULTILINE)
        path.write_text(text)
    shutil.rmtree(out / "edgespec", ignore_errors=True)


def generated_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="fail if the committed code differs from a fresh generation")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        generate(fresh)
        if args.check:
            names = generated_files(fresh)
            stale = [n for n in names if not (OUT / n).exists()
                     or not filecmp.cmp(fresh / n, OUT / n, shallow=False)]
            extra = sorted(set(generated_files(OUT)) - set(names))
            if stale or extra:
                print(f"stale generated code in {OUT}: {stale + extra}; "
                      "run `python proto/generate.py`", file=sys.stderr)
                return 1
            print("generated code is up to date")
            return 0
        for name in generated_files(fresh):
            shutil.copyfile(fresh / name, OUT / name)
    print(f"wrote {', '.join(generated_files(OUT))} to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
