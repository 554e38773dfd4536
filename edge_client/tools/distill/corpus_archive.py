"""The corpus's token ids kept in the repository (``corpus --archive DIR``), so that a session
on a fresh machine continues the corpus instead of writing it again.

Why: a session's machine is replaced between sessions and only the repository survives, while
ten million target tokens take the target dozens of CPU-hours to write. The shards themselves
cannot travel (top-64 ids and log-probabilities are ~260 bytes a token, 218 MB at 847k); the
token ids can (2 bytes a token, compressed). A restore skips the prompt stage (half of a
chunk's wall time) and gives back the same data rather than a new draw. The top-k are
labelled again, teacher-forced, by the corpus's engine: vLLM's prompt logprobs
(``VllmWriter.label``, one prefill a row) or the built-in target (``data.label_rows``; 280 data
tokens/s in float32 on the AVX512-BF16 host, where vLLM in bfloat16 writes 466-506).

Layout: ``DIR/settings.json`` (the corpus settings, checked like ``corpus.json``'s) and per chunk
``DIR/chunk-NNNN/chunk.json`` (its manifest entry and the SHA-256 of its prompt file),
``data-prompts.jsonl.gz`` and one ``shard-NNNNN.npz`` of ids per shard (prompt and generated
ids as uint16, offsets, the greedy/sampled flags and prompt indices: ``shards.write_shard``'s
arrays less the top-k). Every file is written atomically and only once it is complete.

Restoring writes the chunk's prompt file back byte for byte (checked against its digest) and
each shard with the top-k that the labeller computes over prompt + continuation; ``gen-data``
then goes on with the chunk's next shard as if it had
never stopped. The manifest says which shards were labelled again and by what; ``chunks``
limits the labelling to what a run needs. ``train`` also reads an archived shard as it is,
each token its own one-hot label (``shards.read_shard``), with no labelling at all.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import time
from pathlib import Path

import numpy as np

from edge_client.tools.distill.common import write_json
from edge_client.tools.distill.shards import Sample, write_shard

log = logging.getLogger("edgespec.distill")

LABELS = "builtin-float32"  # the default labeller of restored shards: the built-in target


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}{path.suffix}")
    write(tmp)
    os.replace(tmp, path)


def check_settings(archive: Path, settings: dict) -> None:
    """An archive holds one corpus: refuses other settings, and records them when new."""
    from edge_client.tools.distill.magpie import KINDS as MIX  # per chunk: in each entry

    path = archive / "settings.json"
    if path.exists():
        stored = json.loads(path.read_text())
        diff = [f"--{k.replace('_', '-')} {stored[k]} (not {settings.get(k)})"
                for k in stored if k not in MIX and stored[k] != settings.get(k)]
        if diff:
            raise ValueError(f"the archive {archive} holds a corpus with other settings: "
                             f"{', '.join(diff)}")
        if set(stored) & set(MIX):  # written when the prompt mix was corpus-wide
            write_json(path, {k: v for k, v in stored.items() if k not in MIX})
    else:
        archive.mkdir(parents=True, exist_ok=True)
        write_json(path, settings)


def pack(out: Path, archive: Path, manifest: dict) -> int:
    """Copies into ``archive`` the ids of every shard of ``out`` it lacks, and each chunk's
    prompt file and manifest entry. Returns the shards packed. Idempotent."""
    packed = 0
    for name, entry in sorted(manifest["chunks"].items()):
        cdir, adir = out / name, archive / name
        prompts = cdir / "data-prompts.jsonl"
        if not prompts.exists():
            continue
        adir.mkdir(parents=True, exist_ok=True)
        gz, meta_path = adir / "data-prompts.jsonl.gz", adir / "chunk.json"
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        if not gz.exists() or "prompts_sha256" not in meta:
            # mtime=0: the same prompts give the same bytes, so git sees no change on a repack
            raw = gzip.compress(prompts.read_bytes(), mtime=0)
            _atomic(gz, lambda p, b=raw: p.write_bytes(b))
            meta["prompts_sha256"] = _digest(prompts)  # a chunk's prompt file is written once
        for shard in sorted((cdir / "data").glob("shard-*.npz")):
            target = adir / shard.name
            if not target.exists():
                _atomic(target, lambda p, s=shard: _write_ids(s, p))
                packed += 1
        # "restored" says what this machine re-labelled; the archive keeps the entry as
        # generated, so a restoring machine's counts land in it but its history does not.
        kept = {k: v for k, v in entry.items() if k != "restored"}
        if meta.get("entry") != kept:  # after every shard: rewrite only what changed
            write_json(meta_path, {"entry": kept, "prompts_sha256": meta["prompts_sha256"]})
    return packed


def _write_ids(shard: Path, path: Path) -> None:
    with np.load(shard) as z:
        arrays = {k: z[k] for k in ("prompt_ids", "prompt_offsets", "gen_ids", "gen_offsets",
                                    "sampled", "prompt_index")}
    for k in ("prompt_ids", "gen_ids"):
        if arrays[k].size and int(arrays[k].max()) >= 2**16:
            raise ValueError(f"{shard}: token ids above 65535 do not fit the archive")
        arrays[k] = arrays[k].astype(np.uint16)
    for k in ("prompt_offsets", "gen_offsets", "prompt_index"):
        arrays[k] = arrays[k].astype(np.int32)
    np.savez_compressed(path, **arrays)


def read_ids(path: Path) -> tuple[list[Sample], np.ndarray]:
    """An archived shard's samples (no top-k yet) and their prompt indices."""
    with np.load(path) as z:
        po, go = z["prompt_offsets"], z["gen_offsets"]
        samples = [Sample(z["prompt_ids"][po[i]:po[i + 1]].astype(np.int64),
                          z["gen_ids"][go[i]:go[i + 1]].astype(np.int64),
                          np.zeros((0, 0), np.int64), np.zeros((0, 0), np.float16),
                          bool(z["sampled"][i])) for i in range(len(po) - 1)]
        return samples, z["prompt_index"].astype(np.int64)


class _Labeller:
    """The built-in target, loaded on first need, labelling rows in length-sorted batches."""

    def __init__(self, target: Path | None, top_k: int, batch_size: int) -> None:
        self.target_dir, self.top_k, self.batch_size = target, top_k, batch_size
        self.target = None

    def __call__(self, samples: list[Sample]) -> list[Sample]:
        from cloud_verifier.target_model import load_target
        from edge_client.tools.distill.data import label_rows

        if self.target is None:
            self.target = load_target(self.target_dir, device="cpu")
        pad = self.target.eos_token_ids[0]
        order = sorted(range(len(samples)), key=lambda i: len(samples[i].prompt_ids)
                       + len(samples[i].gen_ids))
        out: list[Sample | None] = [None] * len(samples)
        for b in range(0, len(order), self.batch_size):
            idx = order[b:b + self.batch_size]
            for i, row in zip(idx, label_rows(self.target.model, [samples[i] for i in idx],
                                              self.top_k, pad), strict=True):
                out[i] = row
        return out  # type: ignore[return-value]


def restore(archive: Path, out: Path, manifest: dict, top_k: int, target: Path | None = None,
            batch_size: int = 8, time_left=None, progress: bool = True,
            labeller=None, labels: str = LABELS, chunks: set[int] | None = None) -> dict:
    """Writes back into ``out`` every archived chunk (prompt file and manifest entry) and the
    shards that ``out`` lacks, the top-k labelled again by ``labeller(samples) -> samples``
    (named ``labels`` in the manifest; default: the built-in target). ``chunks``: the finished
    chunks whose shards to label (None: all); an unfinished chunk's shards always come back, as
    its next shard follows them. Updates ``manifest`` (the caller saves it) and returns what it
    restored. Stops between shards when ``time_left(seconds)`` says no."""
    from edge_client.tools.distill.data import record_shard
    from edge_client.tools.distill.magpie import progress_bar

    metas = {c: json.loads((c / "chunk.json").read_text())
             for c in sorted(archive.glob("chunk-*")) if (c / "chunk.json").exists()}

    def wanted(adir: Path) -> bool:
        return (chunks is None or not metas[adir]["entry"].get("done")
                or int(adir.name.split("-")[1]) in chunks)

    todo = [(c, s) for c in metas if wanted(c) for s in sorted(c.glob("shard-*.npz"))
            if not (out / c.name / "data" / s.name).exists()]
    done = {"shards": 0, "tokens": 0, "seconds": 0.0, "left": len(todo),
            "unlabelled_chunks": sum(not wanted(c) for c in metas)}
    for adir, meta in metas.items():
        cdir = out / adir.name
        prompts = cdir / "data-prompts.jsonl"
        if not prompts.exists():
            cdir.mkdir(parents=True, exist_ok=True)
            raw = gzip.decompress((adir / "data-prompts.jsonl.gz").read_bytes())
            if hashlib.sha256(raw).hexdigest() != meta["prompts_sha256"]:
                raise ValueError(f"{adir}: the archived prompt file does not match its digest")
            _atomic(prompts, lambda p, b=raw: p.write_bytes(b))
        if adir.name not in manifest["chunks"]:
            # labels None: its ids only, for the dedup and the counts (not trainable here)
            manifest["chunks"][adir.name] = {**meta["entry"], "restored": {
                "labels": labels if wanted(adir) else None}}
    if not todo:
        return done
    labeller = labeller or _Labeller(target, top_k, batch_size)
    bar = progress_bar(len(todo), 0, "restore", progress, unit="shard")
    last_s = 0.0
    try:
        for adir, shard in todo:
            if time_left is not None and not time_left(last_s):
                log.info("restore: time is up with %d shards left", done["left"])
                break
            t0 = time.perf_counter()
            samples, index = read_ids(shard)
            labelled = labeller(samples)
            data = out / adir.name / "data"
            data.mkdir(parents=True, exist_ok=True)
            write_shard(data / shard.name, labelled, index.tolist())
            tokens = sum(len(s.gen_ids) for s in samples)
            last_s = time.perf_counter() - t0
            engine = manifest["chunks"][adir.name].get("engine", "unknown")
            record_shard(data, shard.name, len(samples), tokens, last_s,
                         engine=f"{engine}, labels {labels} (restored)")
            entry = manifest["chunks"][adir.name]
            entry.setdefault("restored", {})["labels"] = labels
            entry["restored"]["shards"] = entry["restored"].get("shards", 0) + 1
            entry["restored"]["seconds"] = round(entry["restored"].get("seconds", 0) + last_s, 1)
            done["shards"] += 1
            done["tokens"] += tokens
            done["seconds"] += last_s
            done["left"] -= 1
            bar.update(1)
            log.info("restored %s/%s: %d tokens in %.0f s (%.0f tok/s)", adir.name, shard.name,
                     tokens, last_s, tokens / max(last_s, 1e-9))
    finally:
        bar.close()
    return done
