"""``gen-prompts``: training prompts that look like use, written by the target itself.

A draft distilled only on templated prompts does well on its own held-out split and badly on
natural prompts, because every prompt it saw came from the same few templates. This stage
writes prompt files (module ``prompt_file``) that ``gen-data --prompts-file`` continues, from
four sources:

- ``magpie`` (Magpie, arXiv 2406.08464): the chat template is rendered up to where a user turn's
  text begins (module ``turn_sampling``) and the target samples the user's message itself, until
  its end-of-turn token; an aligned model's idea of "what a user says" is varied and natural.
- ``multiturn``: a Magpie user turn, the target's answer to it, then a follow-up user turn
  sampled the same way after the answer; written as a conversation, which ``gen-data`` renders
  whole, so the draft learns the assistant's second answer.
- ``ime``: raw text with no chat template, what a user is typing: the target continues a
  neutral sentence opener (``OPENERS``), or writes a user turn, and the text is cut at a random
  word boundary into a 3-15 word prefix.
- ``request``: a Magpie user turn whose first words are a request opener
  (``REQUEST_OPENERS``: asking for advice, steps, an email, a list, code, a poem...), which the
  target finishes at ``--request-temperature``. Unsteered Magpie turns from this small target
  are often nonsense, and the draft's acceptance on them (0.554 on unseen corpus rows, first
  32 tokens) says little about what people type (0.454 on the realistic set): the openers steer
  the turns toward the kinds of request people make, still in the target's own words.

Records: ``{"id", "source", "prompt" | "messages" | "text", "seed"}`` (``seed``: the round's;
IME records also say ``from``: "opener" or "user"). Every candidate is filtered (unfinished,
special tokens, empty, too short or long, not mostly printable, a repetition loop; multiturn
answers too), deduplicated on normalized text, and dropped if it shares a shingle with the
realistic evaluation set (``edge_client.bench.eval_set.overlaps``): none of it may leak into
training.

Resumable: each kind is one deterministic stream of rounds (round r samples one batch with a
seed derived from ``--seed``, the kind and r). Accepted records are written in chunks
(``chunks/<kind>-NNNNN.jsonl``, atomically, about every ``--chunk-size``); a rerun reads them
back and continues at the next round, so a run with a larger count extends the same stream and
never regenerates what exists. ``<kind>.jsonl`` and ``prompts.jsonl`` (all kinds) hold the first
``count`` records of each stream; ``stats.json`` the counts kept and filtered by reason, the
wall time and the target tokens sampled per stage. Streams depend on the settings in
``config.json``, the engine included, which a rerun must keep.

Engines (``--engine``): ``builtin`` samples each round's batch in torch from one generator
seeded with the round's seed; ``vllm`` (module ``magpie_vllm``, the vllm extra) sends the round's
requests to vLLM's continuous batching, each request seeded from the round's seed and its place
in the round. Both implement ``turn_sampling.TurnSampler``; the rounds, the filters, the dedup
and the overlap check are the same code on both. The two engines write different streams.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from hashlib import sha256
from pathlib import Path

from edge_client.tools.distill.common import (
    add_engine_arguments,
    check_engine,
    engine_label,
    jsonable,
    write_json,
)
from edge_client.tools.distill.prompt_file import write_jsonl
from edge_client.tools.distill.turn_sampling import TurnSampler

log = logging.getLogger("edgespec.distill")

KINDS = ("magpie", "multiturn", "ime", "request")
# Neutral starts for raw IME text: sentence openers common in messages and notes.
OPENERS = ("I", "I think", "I was", "I just", "I need to", "We", "We should", "My", "The",
           "This", "It", "There is", "Can you", "Could you", "Do you", "Did you", "Hi", "Hey",
           "Thanks for", "Just", "Please", "So", "If", "When", "After", "Before", "Let me",
           "Don't forget", "Our", "What", "How", "Why", "Is it", "Good morning", "Sorry",
           "Remember", "Quick question", "Not sure", "Today", "Tomorrow")
# First words of a user's request, across the kinds people ask an assistant for.
REQUEST_OPENERS = (
    "I need advice on", "What should I do if", "Any tips for", "How can I stop", "Should I",
    "What's the best way to", "I'm struggling with", "How do I deal with", "How do I",
    "How can I", "What are the steps to", "Explain how to", "Can you walk me through",
    "Write an email to", "Draft a short email", "Write a polite message to", "Help me reply to",
    "Write a thank-you note to", "Write a text message to", "Write a cover letter for",
    "List five", "Give me three tips for", "Give me a list of", "What are some", "Name ten",
    "Suggest a few", "Make a checklist for", "Write a Python function that",
    "How do I fix this error:", "Write a SQL query that", "Explain what this code does:",
    "Write a JavaScript function to", "What is the difference between", "Write a short poem about",
    "Write a short story about", "Write a haiku about", "Come up with a name for", "Write a funny",
    "Describe", "Write a limerick about", "Write a toast for", "Can you explain", "Why do",
    "What is", "Summarize", "Rewrite this sentence:", "Help me write", "Compare", "Plan a",
    "Recommend", "Is it true that", "What happens if", "Give me an example of",
    "Write a recipe for",
    # Added for chunk 23 on: more of the kinds the v9 draft accepted least on (advice 0.40,
    # creative 0.38, code 0.45 greedy alpha); chunks keep the list they were made with.
    "How should I handle", "What would you do if", "I can't decide whether to",
    "Is it a good idea to", "How do I tell my", "How do I get better at", "My friend keeps",
    "Write a bash script that", "Write a regular expression that", "Why does my Python code",
    "How do I read a file in", "Write a function in", "Write unit tests for",
    "Write a story where", "Write a song about", "Write a dialogue between",
    "Write a bedtime story about", "Write a poem for", "Write the opening line of a novel about",
    "Write a riddle about")
# Settings a stream depends on; a rerun into the same --out must keep them.
_STREAM_FIELDS = ("target", "seed", "batch_size", "temperature", "top_p", "max_user_tokens",
                  "answer_temperature", "max_answer_tokens", "min_words", "max_words",
                  "min_printable", "keep_unfinished", "ime_max_tokens", "ime_min_words",
                  "ime_max_words", "ime_user_share", "ime_openers", "user_prefix", "engine",
                  "dtype", "request_openers", "request_temperature")


@dataclass(frozen=True)
class MagpieConfig:
    out: Path
    target: Path | None = None
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    seed: int = 0
    batch_size: int = 16
    temperature: float = 1.0  # user turns and IME text
    top_p: float = 0.99
    max_user_tokens: int = 128  # a user turn that is not over by then is dropped
    answer_temperature: float = 0.0  # multiturn answers; 0: greedy
    max_answer_tokens: int = 160
    min_words: int = 3
    max_words: int = 200
    min_printable: float = 0.95
    keep_unfinished: bool = False  # keep user turns cut by max_user_tokens
    ime_max_tokens: int = 32
    ime_min_words: int = 3
    ime_max_words: int = 15
    ime_user_share: float = 0.5  # IME rows cut from a sampled user turn (the rest: an opener)
    ime_openers: tuple[str, ...] = OPENERS
    request_openers: tuple[str, ...] = REQUEST_OPENERS
    request_temperature: float = 0.8  # lower than magpie's 1.0: the opener already varies them
    user_prefix: str | None = None  # override the first user turn's prefix (rendered text)
    chunk_size: int = 64
    max_tries: int = 20  # a stage gives up after max_tries * count candidates
    threads: int = 0
    progress: bool = True
    engine: str = "builtin"  # who samples: torch here, or vLLM (module magpie_vllm)
    dtype: str = "float32"  # vLLM's dtype (the built-in engine runs the target in float32)


@dataclass
class _Stream:
    """One kind's accepted records and where its rounds stand, read back from its chunks."""

    kind: str
    folder: Path
    records: list[dict] = field(default_factory=list)
    seen: set[str] = field(default_factory=set)
    next_round: int = 0
    chunks: int = 0
    candidates: int = 0
    seconds: float = 0.0
    tokens: int = 0
    filtered: Counter = field(default_factory=Counter)

    def load(self) -> _Stream:
        for path in sorted(self.folder.glob(f"{self.kind}-*.jsonl")):
            lines = path.read_text(encoding="utf-8").splitlines()
            meta = json.loads(lines[0])["chunk"]
            if meta["index"] != self.chunks or meta["first_round"] != self.next_round:
                raise ValueError(f"{path} does not follow the chunks before it")
            for record in map(json.loads, lines[1:]):
                self.add(record, record_key(self.kind, record))
            self.chunks, self.next_round = self.chunks + 1, meta["next_round"]
            self.candidates += meta["candidates"]
            self.seconds += meta["seconds"]
            self.tokens += meta.get("tokens", 0)  # chunks written before tokens were counted
            self.filtered.update(meta["filtered"])
        return self

    def add(self, record: dict, key: str) -> None:
        self.records.append(record)
        self.seen.add(key)

    def flush(self, start: int, first_round: int, candidates: int, filtered: Counter,
              seconds: float, tokens: int) -> None:
        meta = {"index": self.chunks, "first_round": first_round, "next_round": self.next_round,
                "candidates": candidates, "filtered": dict(filtered),
                "seconds": round(seconds, 3), "tokens": tokens}
        write_jsonl(self.folder / f"{self.kind}-{self.chunks:05d}.jsonl",
                    [{"chunk": meta}, *self.records[start:]])
        self.chunks += 1
        self.candidates += candidates
        self.seconds += seconds
        self.tokens += tokens
        self.filtered.update(filtered)


def record_key(kind: str, record: dict) -> str:
    """What two records of a kind share when they are the same prompt (``corpus`` dedups
    across chunks with it)."""
    from edge_client.bench.eval_set import normalize

    if kind == "multiturn":
        return "\n".join(normalize(m["content"]) for m in record["messages"][::2])
    return normalize(record["text"] if kind == "ime" else record["prompt"])


def round_seed(seed: int, kind: str, rnd: int) -> int:
    return int.from_bytes(sha256(f"{seed}:{kind}:{rnd}".encode()).digest()[:7], "little")


def text_reason(text: str, ids: list[int], finished: bool, special: set[int], cfg: MagpieConfig,
                min_words: int, max_words: int) -> str | None:
    """Why a sampled turn is dropped, or None to keep it."""
    if not finished and not cfg.keep_unfinished:
        return "unfinished"
    if special.intersection(ids):
        return "special_token"
    if not text.strip():
        return "empty"
    printable = sum(c.isprintable() or c in "\n\t" for c in text) / len(text)
    if printable < cfg.min_printable or "\ufffd" in text:
        return "unprintable"
    words = text.lower().split()
    if len(words) < min_words:
        return "too_short"
    if len(words) > max_words:
        return "too_long"
    return "repetitive" if repetitive(words) else None


def repetitive(words: list[str], n: int = 3, min_distinct: float = 0.6) -> bool:
    """A degenerate loop ("data science consulting, data science consulting, ..."): few of
    the text's word n-grams are distinct."""
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    return len(grams) >= 10 and len(set(grams)) < min_distinct * len(grams)


class _TorchSampler(TurnSampler):
    """The built-in engine: the target in torch, one generator per round (``sample_batch``)."""

    def __init__(self, cfg: MagpieConfig) -> None:
        import torch

        from cloud_verifier.target_model import load_target
        from edge_client.tools.distill.common import default_target

        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.target = load_target(cfg.target, device="cpu")
        target_dir = Path(cfg.target) if cfg.target is not None else default_target()
        super().__init__(cfg, target_dir, self.target.eos_token_ids)
        self.pad = self.target.eos_token_ids[0]

    def draws(self, seed: int):
        import torch

        return torch.Generator().manual_seed(seed)

    def sample(self, prompts, max_new: int, temperature: float, draws):
        from edge_client.tools.distill.turn_sampling import sample_batch

        outs = sample_batch(self.target.model, prompts, stop_ids=self.stop, max_new=max_new,
                            temperature=temperature, top_p=self.cfg.top_p, pad_id=self.pad,
                            gen=draws)
        self.tokens += sum(len(ids) + done for ids, done in outs)
        return outs


Candidate = tuple[dict, list[str]]  # the record's body, and its texts for the overlap check
RoundFn = Callable[[int], tuple[list[Candidate], Counter]]


def _magpie_round(s: TurnSampler, seed: int) -> tuple[list[Candidate], Counter]:
    cfg, reasons, out = s.cfg, Counter(), []
    gen = s.draws(seed)
    for text, ids, done in s.user_turns([s.user_ids] * cfg.batch_size, gen):
        why = text_reason(text, ids, done, s.special, cfg, cfg.min_words, cfg.max_words)
        if why:
            reasons[why] += 1
        else:
            out.append(({"prompt": text}, [text]))
    return out, reasons


_SENTENCE_END = re.compile(r"[.!?)](?=\s|$)")


def _trim_answer(text: str, finished: bool) -> str:
    """An answer cut by the token cap ends at its last full sentence, when it has one."""
    ends = list(_SENTENCE_END.finditer(text))
    if finished or not ends or ends[-1].end() < len(text) // 3:
        return text
    return text[:ends[-1].end()]


def _multiturn_round(s: TurnSampler, seed: int) -> tuple[list[Candidate], Counter]:
    cfg, reasons = s.cfg, Counter()
    gen = s.draws(seed)
    firsts = []
    for text, ids, done in s.user_turns([s.user_ids] * cfg.batch_size, gen):
        why = text_reason(text, ids, done, s.special, cfg, cfg.min_words, cfg.max_words)
        if why:
            reasons[f"first_{why}"] += 1
        else:
            firsts.append(text)
    if not firsts:
        return [], reasons
    asked = [s.tok.encode(s.tok.apply_chat_template([{"role": "user", "content": f}]))
             for f in firsts]
    answers = s.sample(asked, cfg.max_answer_tokens, cfg.answer_temperature, gen)
    convs = []
    for first, (ids, done) in zip(firsts, answers, strict=True):
        answer = _trim_answer(s.tok.decode(ids).strip(), done)
        if not answer or s.special.intersection(ids) or repetitive(answer.lower().split()):
            reasons["bad_answer"] += 1
        else:
            convs.append([{"role": "user", "content": first},
                          {"role": "assistant", "content": answer}])
    if not convs:
        return [], reasons
    follow = [s.follow_up_ids(c) for c in convs]
    out = []
    for conv, (text, ids, done) in zip(convs, s.user_turns(follow, gen), strict=True):
        why = text_reason(text, ids, done, s.special, cfg, cfg.min_words, cfg.max_words)
        if not why and text.strip() == conv[0]["content"]:
            why = "repeats_first"
        if why:
            reasons[why] += 1
            continue
        messages = [*conv, {"role": "user", "content": text}]
        out.append(({"messages": messages}, [m["content"] for m in messages]))
    return out, reasons


def _ime_round(s: TurnSampler, seed: int) -> tuple[list[Candidate], Counter]:
    import numpy as np

    cfg, reasons, out = s.cfg, Counter(), []
    gen, rng = s.draws(seed), np.random.default_rng(seed)
    from_user = rng.random(cfg.batch_size) < cfg.ime_user_share
    opener = rng.integers(len(cfg.ime_openers), size=cfg.batch_size)
    cut = rng.random(cfg.batch_size)
    starts = [s.user_ids if u else s.start_ids(cfg.ime_openers[o])
              for u, o in zip(from_user, opener, strict=True)]
    outs = s.sample(starts, cfg.ime_max_tokens, cfg.temperature, gen)
    for j, (ids, done) in enumerate(outs):
        text = s.tok.decode(ids if from_user[j] else [*starts[j], *ids]).lstrip()
        finished = done or "\n" in text  # a line that ended holds only whole words
        line = text.split("\n")[0]
        words = list(re.finditer(r"\S+", line))
        # Cut inside the line (a prefix, not a finished text) unless it is only just long enough.
        whole = finished and len(words) == cfg.ime_min_words
        most = min(cfg.ime_max_words, len(words) if whole else len(words) - 1)
        why = "special_token" if s.special.intersection(ids) else None
        if not why and most < cfg.ime_min_words:
            why = "too_short"
        if not why:
            k = cfg.ime_min_words + int(cut[j] * (most - cfg.ime_min_words + 1))
            line = line[:words[k - 1].end()]
            why = text_reason(line, [], True, s.special, cfg, cfg.ime_min_words,
                              cfg.ime_max_words)
        if why:
            reasons[why] += 1
        else:
            out.append(({"text": line, "from": "user" if from_user[j] else "opener"}, [line]))
    return out, reasons


def _request_round(s: TurnSampler, seed: int) -> tuple[list[Candidate], Counter]:
    import numpy as np

    cfg, reasons, out = s.cfg, Counter(), []
    pick = np.random.default_rng(seed).integers(len(cfg.request_openers), size=cfg.batch_size)
    openers = [cfg.request_openers[i] for i in pick]
    starts = [[*s.user_ids, *s.tok.encode(o)] for o in openers]
    outs = s.sample(starts, cfg.max_user_tokens, cfg.request_temperature, s.draws(seed))
    for opener, (ids, done) in zip(openers, outs, strict=True):
        text = (opener + s.tok.decode(ids)).strip()
        why = text_reason(text, ids, done, s.special, cfg, cfg.min_words, cfg.max_words)
        if why:
            reasons[why] += 1
        else:
            out.append(({"prompt": text, "opener": opener}, [text]))
    return out, reasons


_ROUNDS = {"magpie": _magpie_round, "multiturn": _multiturn_round, "ime": _ime_round,
           "request": _request_round}


def progress_bar(total: int, initial: int, desc: str, enabled: bool, unit: str = "prompt"):
    """A tqdm bar with its ETA (the ``bench`` extra), or a stand-in that shows nothing."""
    try:
        from tqdm import tqdm
    except ImportError:
        enabled = False
    if not enabled:
        class _NoBar:
            def update(self, n: int = 1) -> None: ...
            def close(self) -> None: ...
        return _NoBar()
    return tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True,
                unit_scale=unit != "prompt")


def _run_stage(stream: _Stream, want: int, rounds: RoundFn, overlapping, cfg: MagpieConfig,
               sampled: Callable[[], int] = lambda: 0) -> float:
    """Extends ``stream`` to ``want`` records; returns this run's seconds on it. ``sampled``:
    the target tokens sampled so far (each chunk records the ones its rounds sampled)."""
    t_run = time.perf_counter()
    bar = progress_bar(want, min(len(stream.records), want), stream.kind, cfg.progress)
    start, first_round, t0 = len(stream.records), stream.next_round, time.perf_counter()
    candidates, filtered, tokens0 = 0, Counter(), sampled()
    while len(stream.records) < want:
        if stream.candidates + candidates >= cfg.max_tries * want:
            log.warning("%s: %d candidates gave only %d prompts; stopping (raise --max-tries)",
                        stream.kind, stream.candidates + candidates, len(stream.records))
            break
        seed = round_seed(cfg.seed, stream.kind, stream.next_round)
        found, reasons = rounds(seed)
        candidates += sum(reasons.values()) + len(found)
        filtered.update(reasons)
        flagged = overlapping([t for _, texts in found for t in texts])
        pos, before = 0, len(stream.records)
        for body, texts in found:
            hit, pos = any(i in flagged for i in range(pos, pos + len(texts))), pos + len(texts)
            record = {"id": f"{stream.kind}-{len(stream.records):06d}", "source": stream.kind,
                      **body, "seed": seed}
            key = record_key(stream.kind, record)
            if key in stream.seen:
                filtered["duplicate"] += 1
            elif hit:
                filtered["eval_overlap"] += 1
            else:
                stream.add(record, key)
        stream.next_round += 1
        bar.update(min(len(stream.records), want) - min(before, want))
        if len(stream.records) - start >= cfg.chunk_size or len(stream.records) >= want:
            stream.flush(start, first_round, candidates, filtered, time.perf_counter() - t0,
                         sampled() - tokens0)
            start, first_round, t0 = len(stream.records), stream.next_round, time.perf_counter()
            candidates, filtered, tokens0 = 0, Counter(), sampled()
    if stream.next_round > first_round:  # the stage gave up between chunks
        stream.flush(start, first_round, candidates, filtered, time.perf_counter() - t0,
                     sampled() - tokens0)
    bar.close()
    return time.perf_counter() - t_run


def _check_config(path: Path, cfg: MagpieConfig) -> None:
    """Refuses to extend streams made with other settings (another engine's included: the
    engines sample different streams from the same seeds)."""
    wanted = {k: v for k, v in jsonable(asdict(cfg)).items() if k in _STREAM_FIELDS}
    if path.exists():
        stored = json.loads(path.read_text())
        # Directories written before the engine was a setting were the built-in engine's.
        defaults = jsonable(asdict(MagpieConfig(Path())))
        diff = {k: stored.get(k, defaults[k]) for k in _STREAM_FIELDS
                if stored.get(k, defaults[k]) != wanted[k]}
        if diff:
            detail = ", ".join(f"{k} {json.dumps(old)} (not {json.dumps(wanted[k])})"
                               for k, old in diff.items())
            raise ValueError(f"{path.parent} was generated with other {', '.join(diff)}: "
                             f"{detail}; rerun with the same settings, or use a new --out")
    write_json(path, wanted)


def _start_sampler(cfg: MagpieConfig, vllm_writer=None) -> TurnSampler:
    if cfg.engine == "builtin":
        return _TorchSampler(cfg)
    from edge_client.tools.distill.magpie_vllm import VllmTurnSampler

    return VllmTurnSampler(cfg, vllm_writer)


def gen_prompts(cfg: MagpieConfig, eval_prompts=None, vllm_writer=None) -> dict:
    """Fills ``cfg.out`` up to ``cfg.counts`` per kind; returns the stats (also stats.json).
    ``eval_prompts`` are the prompts no record may overlap (default: the whole eval set).
    ``vllm_writer``: a running ``data_vllm.VllmWriter`` on the target for ``--engine vllm``
    (default: start one when there is something to sample)."""
    from edge_client.bench.eval_set import load_eval, overlaps

    check_engine(cfg.engine, cfg.dtype)
    out = Path(cfg.out)
    (out / "chunks").mkdir(parents=True, exist_ok=True)
    _check_config(out / "config.json", cfg)
    eval_prompts = list(load_eval() if eval_prompts is None else eval_prompts)

    def overlapping(texts: list[str]) -> set[int]:
        return {o.text_index for o in overlaps(texts, eval_prompts)} if texts else set()

    streams = {k: _Stream(k, out / "chunks").load() for k in KINDS}
    todo = [k for k in KINDS if cfg.counts.get(k, 0) > len(streams[k].records)]
    sampler = _start_sampler(cfg, vllm_writer) if todo else None
    this_run = dict.fromkeys(KINDS, 0.0)
    for kind in todo:
        fn = _ROUNDS[kind]
        this_run[kind] = _run_stage(streams[kind], cfg.counts[kind],
                                    lambda seed, fn=fn: fn(sampler, seed), overlapping, cfg,
                                    lambda: sampler.tokens)
        write_jsonl(out / f"{kind}.jsonl", streams[kind].records[:cfg.counts[kind]])
    merged = [r for k in KINDS for r in streams[k].records[:cfg.counts.get(k, 0)]]
    write_jsonl(out / "prompts.jsonl", merged)
    stats = {"stages": {}, "prompts_file": str(out / "prompts.jsonl"), "records": len(merged),
             "engine": engine_label(cfg.engine, cfg.dtype)}
    for kind in KINDS:
        st = streams[kind]
        stats["stages"][kind] = {
            "wanted": cfg.counts.get(kind, 0),
            "kept": min(len(st.records), cfg.counts.get(kind, 0)),
            "generated": len(st.records), "candidates": st.candidates, "rounds": st.next_round,
            "filtered": dict(sorted(st.filtered.items())), "seconds": round(st.seconds, 1),
            "seconds_this_run": round(this_run[kind], 1),
            "per_minute": round(60 * len(st.records) / st.seconds, 1) if st.seconds else None,
            # Every target token sampled, the filtered candidates' and the answers' included.
            "tokens": st.tokens,
            "tokens_per_s": round(st.tokens / st.seconds, 1) if st.seconds else None}
    write_json(out / "stats.json", stats)
    return stats


def print_stats(stats: dict) -> None:
    for kind, st in stats["stages"].items():
        if not st["wanted"] and not st["generated"]:
            continue
        reasons = ", ".join(f"{k} {v}" for k, v in st["filtered"].items()) or "none"
        print(f"{kind:9s} {st['kept']}/{st['wanted']} kept; {st['generated']} accepted of "
              f"{st['candidates']} candidates in {st['rounds']} rounds, {st['seconds']:.1f} s "
              f"({st['seconds_this_run']:.1f} s this run), {st['per_minute'] or 0:.1f}/min, "
              f"{st['tokens']} target tokens ({st['tokens_per_s'] or 0:.1f}/s); "
              f"filtered: {reasons}")
    print(f"{stats['records']} prompts in {stats['prompts_file']} ({stats['engine']})")


def add_parser(sub) -> None:
    g = sub.add_parser("gen-prompts", help="prompts that look like use: Magpie user turns, "
                       "multi-turn conversations, IME fragments, requests (resumable)")
    g.add_argument("--out", type=Path, required=True)
    g.add_argument("--target", type=Path, default=None)
    g.add_argument("--count", type=int, default=0, help="prompts of each kind (default 0)")
    for kind in KINDS:
        g.add_argument(f"--{kind}-count", type=int, default=None,
                       help=f"{kind} prompts (default --count)")
    d = MagpieConfig(Path())
    for name in ("seed", "batch_size", "temperature", "top_p", "max_user_tokens",
                 "answer_temperature", "max_answer_tokens", "min_words", "max_words",
                 "min_printable", "ime_max_tokens", "ime_min_words", "ime_max_words",
                 "ime_user_share", "request_temperature", "chunk_size", "max_tries",
                 "threads"):
        value = getattr(d, name)
        g.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    g.add_argument("--keep-unfinished", action="store_true",
                   help="keep user turns that --max-user-tokens cut short")
    g.add_argument("--user-prefix", default=None,
                   help="rendered text a user turn starts after (default: from the template)")
    g.add_argument("--openers", type=Path, default=None,
                   help="IME openers, one a line (default: the built-in list)")
    g.add_argument("--no-progress", action="store_true")
    add_engine_arguments(g)


def run_cli(args: argparse.Namespace) -> int:
    counts = {k: getattr(args, f"{k}_count") for k in KINDS}
    counts = {k: args.count if v is None else v for k, v in counts.items()}
    openers = OPENERS
    if args.openers is not None:
        openers = tuple(x.strip() for x in args.openers.read_text().splitlines() if x.strip())
    names = [f for f in MagpieConfig.__dataclass_fields__ if hasattr(args, f)]
    cfg = MagpieConfig(**{n: getattr(args, n) for n in names}, counts=counts,
                       ime_openers=openers, progress=not args.no_progress)
    print_stats(gen_prompts(cfg))
    return 0
