"""``edgespec-distill corpus``: the draft's training data at scale, written in bounded,
resumable chunks by one command that a later session reruns unchanged.

A chunk is ``gen-prompts`` then ``gen-data`` in ``<out>/chunk-NNNN/``: use-like prompts
(Magpie user turns, multi-turn follow-ups, IME fragments, requests started by an opener; the
chunk's own "mix" of them is in its manifest entry; the realistic evaluation set's
overlap check is ``gen-prompts``' own) sampled with the chunk's seed, then continued by the
target (greedy and sampled mixed), its top-k recorded at every token. Prompts already in an
earlier chunk are dropped before ``gen-data`` sees them (``data-prompts.jsonl``, written once).
Both stages resume by themselves, so a run cut anywhere loses at most the shard it was on.

``--max-minutes`` bounds a run: no stage starts that the last one's duration says would end
after the bound. ``corpus.json`` is the manifest: every chunk's engine and dtype, the host it
ran on, its prompt sources and counts, the target tokens its prompts cost, its data tokens
(greedy and sampled apart) and seconds, and the totals.

The engine is chosen per run; a chunk keeps the engine and dtype it was started with (its
stages refuse another), so a host with bfloat16 matrix units (``--dtype auto``) writes its new
chunks in bfloat16 and one without writes float32, and the manifest says which.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from edge_client.tools.distill.common import ENGINES, engine_label, jsonable, write_json
from edge_client.tools.distill.magpie import KINDS

log = logging.getLogger("edgespec.distill")

_CHUNK = "chunk-{:04d}"
MIX = KINDS  # the prompt kinds' counts: per chunk, not corpus-wide settings
LEGACY_MIX = {"magpie": 384, "multiturn": 64, "ime": 128, "request": 0}


@dataclass(frozen=True)
class CorpusConfig:
    out: Path
    target: Path | None = None
    target_tokens: int = 10_000_000  # data tokens (the target's continuations) in all
    # Prompts of each kind per chunk, before the cross-chunk dedup. The mix is a chunk's own
    # setting (its manifest entry's "mix"), so it may change between runs: chunks 0-17 were
    # 384 / 64 / 128 / 0 (LEGACY_MIX); request prompts came after (magpie's docstring says why).
    magpie: int = 128
    multiturn: int = 64
    ime: int = 128
    request: int = 256
    max_new_tokens: int = 256
    top_k: int = 64
    sample_fraction: float = 0.5  # the rest greedy
    temperature: float = 0.7
    shard_size: int = 96
    batch_size: int = 64  # gen-prompts' sampling batch (vLLM batches gen-data's shard whole)
    seed: int = 0
    engine: str = "vllm"
    dtype: str = "auto"  # auto: bfloat16 where the CPU has bfloat16 matrix units
    max_minutes: float = 0.0  # 0: no bound
    threads: int = 0
    progress: bool = True
    # MagpieConfig fields that differ from its defaults (e.g. shorter turns on a test target)
    prompt_settings: dict = field(default_factory=dict)
    # Where the corpus's token ids are kept across machines (module corpus_archive): restored
    # from at the start of a run, added to after every shard. None: no archive.
    archive: Path | None = None
    # The finished chunks whose shards a restore labels again: "all", "none" (ids and prompts
    # only: a run that only grows the corpus) or "15-32,40" (the chunks a training run reads).
    # Why: labelling runs at ~630 data tokens/s, hours for the whole corpus on a fresh machine.
    restore_chunks: str = "all"


def host_cpu() -> dict:
    """The CPU's model name and the flags that decide the dtype (figures depend on the host)."""
    model, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
    return {"model": model, "flags": [f for f in wanted if f in flags]}


def resolve_dtype(dtype: str, engine: str, host: dict) -> str:
    if engine == "builtin":
        return "float32"
    if dtype != "auto":
        return dtype
    fast = {"avx512_bf16", "amx_bf16"} & set(host["flags"])
    return "bfloat16" if fast else "float32"


def chunk_seed(seed: int, chunk: int) -> int:
    return seed * 1_000_003 + chunk


def parse_chunks(spec: str) -> set[int] | None:
    """``--restore-chunks``: None for "all", else the chunk numbers ("none", "3", "15-32,40")."""
    spec = spec.strip().lower()
    if spec == "all":
        return None
    chunks: set[int] = set()
    for part in filter(None, spec.split(",")) if spec != "none" else ():
        lo, _, hi = part.partition("-")
        if not lo.strip().isdigit() or (hi and not hi.strip().isdigit()):
            raise ValueError(f"--restore-chunks takes all, none or chunk numbers and ranges "
                             f"like 15-32,40; not {spec!r}")
        a, b = int(lo), int(hi or lo)
        if b < a:
            raise ValueError(f"--restore-chunks: the range {part!r} runs backwards")
        chunks.update(range(a, b + 1))
    return chunks


def read_manifest(out: Path) -> dict:
    path = Path(out) / "corpus.json"
    return json.loads(path.read_text()) if path.exists() else {"chunks": {}}


def _shard_tokens(data_dir: Path) -> dict:
    """Data tokens of a chunk's shards, greedy and sampled apart (read from the shards)."""
    greedy = sampled = prompts = 0
    for path in sorted(data_dir.glob("shard-*.npz")):
        with np.load(path) as z:
            lengths = np.diff(z["gen_offsets"])
            flags = z["sampled"]
        sampled += int(lengths[flags].sum())
        greedy += int(lengths[~flags].sum())
        prompts += len(lengths)
    return {"greedy_tokens": greedy, "sampled_tokens": sampled, "tokens": greedy + sampled,
            "data_prompts_done": prompts}


class Corpus:
    """One run of ``corpus``: chunk after chunk until the tokens are there or time is up."""

    def __init__(self, cfg: CorpusConfig) -> None:
        if cfg.engine not in ENGINES:
            raise ValueError(f"--engine must be builtin or vllm, not {cfg.engine!r}")
        if cfg.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"--dtype must be auto, float32 or bfloat16, not {cfg.dtype!r}")
        counts = [getattr(cfg, k) for k in MIX]
        if min(counts) < 0 or sum(counts) < 1:
            raise ValueError("a chunk needs at least one prompt")
        self.cfg = cfg
        self.out = Path(cfg.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.manifest = read_manifest(self.out)
        self._check_settings()
        self._save()
        self.host = host_cpu()
        self.stop_at = (time.monotonic() + 60 * cfg.max_minutes) if cfg.max_minutes else None
        self.writer = None  # a running VllmWriter, started on first need
        self.writer_dtype = None
        self.seen: set[str] = set()
        self.skipped: list[str] = []  # unfinished chunks in a dtype other than this run's
        self.last_prompts_s = 0.0
        self.restore_chunks = parse_chunks(cfg.restore_chunks)
        self.archive = Path(cfg.archive) if cfg.archive is not None else None
        if self.archive is not None:
            from edge_client.tools.distill.corpus_archive import check_settings

            check_settings(self.archive, self.manifest["settings"])

    def _check_settings(self) -> None:
        """Chunks made with other data settings would not be one corpus: refuse, say which."""
        keep = ("max_new_tokens", "top_k", "sample_fraction", "temperature", "shard_size",
                "batch_size", "seed")
        stored = self.manifest.get("settings")
        if stored:
            diff = [f"--{k.replace('_', '-')} {stored[k]} (not {getattr(self.cfg, k)})"
                    for k in keep if stored[k] != getattr(self.cfg, k)]
            if diff:
                raise ValueError(f"{self.out} was written with other settings; resume with "
                                 f"{', '.join(diff)}, or use a new --out")
        self.manifest["settings"] = {k: getattr(self.cfg, k) for k in keep}

    def time_left(self, needed_s: float) -> bool:
        return self.stop_at is None or time.monotonic() + needed_s <= self.stop_at

    def done_tokens(self) -> int:
        return sum(c.get("tokens", 0) for c in self.manifest["chunks"].values())

    def run(self) -> dict:
        from edge_client.tools.distill.magpie import progress_bar

        restored = self._restore()  # before the bar: restored tokens are not this run's rate
        bar = progress_bar(self.cfg.target_tokens,
                           min(self.done_tokens(), self.cfg.target_tokens), "corpus",
                           self.cfg.progress, unit="tok")
        chunk, t0, tokens0 = 0, time.perf_counter(), self.done_tokens()
        try:
            while restored["left"] == 0 and self.done_tokens() < self.cfg.target_tokens:
                if not self.run_chunk(chunk, bar):
                    break
                chunk += 1
        finally:
            bar.close()
        made, dt = self.done_tokens() - tokens0, time.perf_counter() - t0
        left = max(self.cfg.target_tokens - self.done_tokens(), 0)
        summary = {"tokens": self.done_tokens(), "target_tokens": self.cfg.target_tokens,
                   "this_run_tokens": made, "this_run_s": round(dt, 1),
                   "this_run_tokens_per_s": round(made / dt, 1) if dt > 0 else None,
                   "eta_h": round(left / (made / dt) / 3600, 1) if made and left else None,
                   "finished": left == 0, "restored": restored,
                   "skipped_chunks": self.skipped}
        self.manifest["last_run"] = {**summary, "host": self.host}
        self._save()
        return summary

    def _restore(self) -> dict:
        """Chunks and shards the archive has and ``out`` lacks, written back (labels
        recomputed), then the archive completed with what only ``out`` has."""
        none = {"shards": 0, "tokens": 0, "seconds": 0.0, "left": 0}
        if self.archive is None:
            return none
        from edge_client.tools.distill.corpus_archive import restore

        labelling = {}
        if self.cfg.engine == "vllm":  # vLLM's prefill labels faster than the built-in target
            dtype = resolve_dtype(self.cfg.dtype, "vllm", self.host)
            labelling = {"labeller": lambda rows: self._writer(dtype).label(rows, self.cfg.top_k),
                         "labels": engine_label("vllm", dtype)}
        done = restore(self.archive, self.out, self.manifest, self.cfg.top_k, self.cfg.target,
                       time_left=self.time_left, progress=self.cfg.progress,
                       chunks=self.restore_chunks, **labelling)
        for name, entry in self.manifest["chunks"].items():
            archived = len(list((self.archive / name).glob("shard-*.npz")))
            local = self.out / name / "data"
            if "restored" in entry and local.exists():
                entry.update(_shard_tokens(local))
                # a chunk is done only with all its shards here; gen-data writes the rest
                entry["done"] = entry.get("done", False) and len(
                    list(local.glob("shard-*.npz"))) >= archived
        self._save()
        self._pack()
        return done

    def _pack(self) -> None:
        if self.archive is not None:
            from edge_client.tools.distill.corpus_archive import pack

            pack(self.out, self.archive, self.manifest)

    def _save(self) -> None:
        chunks = self.manifest["chunks"].values()
        self.manifest["totals"] = {k: sum(c.get(k, 0) for c in chunks) for k in
                                   ("tokens", "greedy_tokens", "sampled_tokens", "data_prompts",
                                    "prompt_stage_tokens")}
        self.manifest["totals"]["by_engine"] = {}
        for c in chunks:
            by = self.manifest["totals"]["by_engine"]
            by[c["engine"]] = by.get(c["engine"], 0) + c.get("tokens", 0)
        write_json(self.out / "corpus.json", self.manifest)

    def _writer(self, dtype: str):
        if self.cfg.engine != "vllm":
            return None
        if self.writer is not None and self.writer_dtype != dtype:
            raise ValueError(f"vLLM runs in {self.writer_dtype} in this run; a chunk started "
                             f"in {dtype} needs a run of its own (--dtype {dtype})")
        if self.writer is None:
            from edge_client.tools.distill.data_vllm import VllmWriter

            self.writer = VllmWriter.start(self.cfg.target, dtype, self.cfg.threads)
            self.writer_dtype = dtype
        return self.writer

    def run_chunk(self, chunk: int, bar) -> bool:
        """Finishes chunk ``chunk`` (or skips it when done). False when time ran out."""
        from edge_client.tools.distill.data import GenConfig, gen_data
        from edge_client.tools.distill.magpie import MagpieConfig, gen_prompts
        from edge_client.tools.distill.prompt_file import write_jsonl

        cfg, name = self.cfg, _CHUNK.format(chunk)
        cdir = self.out / name
        entry = self.manifest["chunks"].get(name)
        if entry and entry.get("done"):
            self.seen |= _keys(cdir / "data-prompts.jsonl")
            return True
        if entry is None:
            if not self.time_left(self.last_prompts_s):
                return False
            dtype = resolve_dtype(cfg.dtype, cfg.engine, self.host)
            if self.writer_dtype is not None:
                dtype = self.writer_dtype  # one vLLM per run; the next run re-decides
            entry = {"engine": engine_label(cfg.engine, dtype), "dtype": dtype,
                     "seed": chunk_seed(cfg.seed, chunk), "host": self.host,
                     "mix": {k: getattr(cfg, k) for k in MIX},
                     "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
            self.manifest["chunks"][name] = entry
            self._save()
        dtype, seed = entry["dtype"], entry["seed"]
        dp = cdir / "data-prompts.jsonl"
        run_dtype = self.writer_dtype or resolve_dtype(cfg.dtype, cfg.engine, self.host)
        if dp.exists() and dtype != run_dtype:
            # A chunk keeps its dtype, and bfloat16 without bfloat16 units runs at a crawl: its
            # rest waits for a run in its dtype; its prompts still count for the dedup.
            log.warning("%s was started in %s; this run writes %s: its other shards are left "
                        "for a run with --dtype %s on a host that has it", name, dtype,
                        run_dtype, dtype)
            self.seen |= _keys(dp)
            self.skipped.append(name)
            return True
        writer = self._writer(dtype)

        if not dp.exists():
            if not self.time_left(self.last_prompts_s):
                return False
            t = time.perf_counter()
            # a chunk keeps the mix it started with (one from before "mix" existed: the legacy)
            counts = {k: entry.get("mix", LEGACY_MIX).get(k, 0) for k in KINDS}
            mcfg = MagpieConfig(cdir / "prompts", cfg.target, counts, seed=seed,
                                batch_size=cfg.batch_size, threads=cfg.threads,
                                progress=cfg.progress, engine=cfg.engine, dtype=dtype)
            stats = gen_prompts(replace(mcfg, **cfg.prompt_settings), vllm_writer=writer)
            self.last_prompts_s = time.perf_counter() - t
            records = [json.loads(x) for x in
                       (cdir / "prompts" / "prompts.jsonl").read_text().splitlines() if x]
            fresh = [r for r in records if _record_key(r) not in self.seen]
            write_jsonl(dp, fresh)
            entry.update(prompts={k: s["kept"] for k, s in stats["stages"].items()},
                         prompt_stage_tokens=sum(s["tokens"] for s in stats["stages"].values()),
                         prompt_stage_s=sum(s["seconds"] for s in stats["stages"].values()),
                         cross_chunk_duplicates=len(records) - len(fresh),
                         data_prompts=len(fresh))
            self._save()
            self._pack()
        self.seen |= _keys(dp)
        if entry["data_prompts"] == 0:  # every prompt was in an earlier chunk
            entry.update(_shard_tokens(cdir / "data"), done=True, shards="0/0", data_s=0.0)
            self._save()
            return True

        gen = GenConfig(cfg.target, cdir / "data", shard_size=cfg.shard_size,
                        max_new_tokens=cfg.max_new_tokens, top_k=cfg.top_k,
                        sample_fraction=cfg.sample_fraction, temperature=cfg.temperature,
                        seed=seed, threads=cfg.threads, prompts_file=dp, engine=cfg.engine,
                        dtype=dtype)

        def shard_done(tokens: int) -> None:
            entry.update(_shard_tokens(cdir / "data"))
            self._save()
            self._pack()
            bar.update(tokens)

        gen_data(gen, vllm_writer=writer, time_left=self.time_left, on_shard=shard_done)
        entry.update(_shard_tokens(cdir / "data"))
        shards = math.ceil(entry["data_prompts"] / cfg.shard_size)
        entry["shards"] = f"{len(list((cdir / 'data').glob('shard-*.npz')))}/{shards}"
        manifest = json.loads((cdir / "data" / "manifest.json").read_text()) \
            if (cdir / "data" / "manifest.json").exists() else {"shards": {}}
        entry["data_s"] = round(sum(s["seconds"] for s in manifest["shards"].values()), 1)
        entry["done"] = entry["data_prompts_done"] >= entry["data_prompts"]
        if entry["done"]:
            entry["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        self._save()
        self._pack()
        return entry["done"]


def _record_key(record: dict) -> str:
    from edge_client.tools.distill.magpie import record_key

    return record_key(record["source"], record)


def _keys(path: Path) -> set[str]:
    if not path.exists():
        return set()
    return {_record_key(json.loads(x)) for x in path.read_text().splitlines() if x}


def add_parser(sub) -> None:
    c = sub.add_parser("corpus", help="use-like prompts continued by the target, in bounded "
                       "resumable chunks, to --target-tokens (rerun the same command to go on)")
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--target", type=Path, default=None)
    d = CorpusConfig(Path())
    for name in ("target_tokens", *MIX, "max_new_tokens", "top_k",
                 "sample_fraction", "temperature", "shard_size", "batch_size", "seed",
                 "max_minutes", "threads"):
        value = getattr(d, name)
        c.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    c.add_argument("--engine", choices=ENGINES, default=d.engine)
    c.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default=d.dtype,
                   help="vLLM's dtype for new chunks (auto: bfloat16 where the CPU has AMX "
                        "or AVX512-BF16, else float32)")
    c.add_argument("--archive", type=Path, default=None,
                   help="keep the corpus's token ids here too (e.g. the repository's "
                        "edge_client/tools/distill/corpus_ids), and restore from it what --out "
                        "lacks, labels recomputed: a fresh machine goes on where the last stopped")
    c.add_argument("--restore-chunks", default=d.restore_chunks,
                   help="which finished chunks of the archive a restore labels again: all, "
                        "none (a run that only adds chunks) or numbers and ranges like 15-32 "
                        "(what a training run reads); unfinished chunks always come back")
    c.add_argument("--no-progress", action="store_true")


def run_cli(args: argparse.Namespace) -> int:
    names = [f for f in CorpusConfig.__dataclass_fields__ if hasattr(args, f)]
    cfg = CorpusConfig(**{n: getattr(args, n) for n in names}, progress=not args.no_progress)
    summary = Corpus(cfg).run()
    print(json.dumps(jsonable(summary)))
    return 0

