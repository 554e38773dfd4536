"""One client with the device and the cloud on separate cores, as on a real deployment where
the draft never shares the verifier's CPU: the verifier on core 1 with one torch thread, the
client (live ONNX drafts, one onnxruntime thread) on core 0. It reports committed tokens per
second of speculative generation (Verify rounds and lookahead) against cloud-only streaming
(Generate) from the same verifier, over prompts of the realistic evaluation set.

    python -m edge_client.bench.separate_cores --per-category 2 --json PATH
    python -m edge_client.bench.separate_cores --feature-head DIR ...   # + the feature head
    python -m edge_client.bench.separate_cores --draft-dir A B ...      # two drafts, interleaved

Each drafter of ``--drafters`` (default: model and combined) runs Verify rounds and lookahead
(named ``rounds`` and ``lookahead`` for the model, ``rounds+NAME`` and ``lookahead+NAME`` for
the others), at each ``--draft-len`` and ``--stop-confidence`` given (a name gains ``/K=8``
or ``/stop=0.1`` when several values are measured, and ``@DIRNAME`` when several
``--draft-dir`` are: their clients take turns on every prompt, so a slow spell of the host
hits every draft alike, which runs one after the other cannot promise). With
``--feature-head`` two more clients take their turn on every prompt: Verify rounds and
lookahead drafting with the feature head (``drafter="feature"``), against the same verifier
(which must serve features: the default).

Greedy, so every protocol commits the same tokens; tokens/s counts the generation from its
first message to its last token. ``vs_cloud_paired`` is the median over prompts of each
run's tokens/s over cloud-only's on the same prompt. Needs two cores (``os.sched_setaffinity``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from edge_client import local_verifier
from edge_client.bench.eval_set import CATEGORIES, load_eval
from edge_client.client import EdgeClient, GenerationConfig
from edge_client.combined_drafter import DRAFTER_KINDS, FEATURE

DRAFTED = ("rounds", "lookahead")


def _prompt_ids(client: EdgeClient, prompt) -> list[int]:
    tok = client.tokenizer
    if not prompt.chat:
        return tok.encode(prompt.raw)
    return tok.encode(tok.apply_chat_template(prompt.chat_messages()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="separate_cores", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="target checkpoint (default: prepared)")
    p.add_argument("--draft-dir", type=Path, nargs="+", default=[None],
                   help="draft directories (default: the shipped draft); several take turns")
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--draft-len", type=int, nargs="+", default=[4])
    p.add_argument("--stop-confidence", type=float, nargs="+", default=[0.0],
                   help="GenerationConfig.stop_confidence values to run each drafter with")
    p.add_argument("--rtt-ms", type=float, default=0.0, help="injected round-trip time")
    p.add_argument("--drafters", nargs="+", default=["model", "combined"],
                   choices=[k for k in DRAFTER_KINDS if k != FEATURE],
                   help="drafters to run rounds and lookahead with")
    p.add_argument("--feature-head", type=Path, default=None, metavar="DIR",
                   help="also run rounds and lookahead with this feature head")
    p.add_argument("--verifier-arg", action="append", default=[], metavar="ARG",
                   help="one more verifier argument, e.g. --verifier-arg=--engine=vllm "
                        "(repeatable)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH")
    args = p.parse_args(argv)
    drafters = list(dict.fromkeys(args.drafters))
    if args.feature_head is not None:
        drafters.append(FEATURE)
    ks, stops = list(dict.fromkeys(args.draft_len)), list(dict.fromkeys(args.stop_confidence))
    drafts = list(dict.fromkeys(args.draft_dir))
    if len({d.name for d in drafts if d is not None}) < len(drafts):
        raise SystemExit("--draft-dir: give directories with different names")

    def run_name(protocol: str, kind: str, k: int, stop: float, draft: Path | None) -> str:
        return (protocol + ("" if kind == "model" else f"+{kind}")
                + (f"/K={k}" if len(ks) > 1 else "")
                + (f"/stop={stop:g}" if len(stops) > 1 else "")
                + (f"@{draft.name}" if len(drafts) > 1 else ""))

    runs = {run_name(protocol, kind, k, stop, draft): (protocol, kind, k, stop, draft)
            for draft in drafts for kind in drafters for k in ks for stop in stops
            for protocol in DRAFTED}
    runs["cloud"] = ("cloud", "model", ks[0], 0.0, drafts[0])
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("separate_cores needs two cores")
    prompts = [q for c in CATEGORIES for q in load_eval([c])[:args.per_category]]
    port = local_verifier.free_port()
    proc = local_verifier.spawn(port, args.model, ["--threads", "1", *args.verifier_arg])
    os.sched_setaffinity(proc.pid, {1})
    os.sched_setaffinity(0, {0})
    results: dict[str, list[float]] = {name: [] for name in runs}
    forwards: dict[str, list[float]] = {name: [] for name in runs}
    bytes_down: dict[str, list[float]] = {name: [] for name in runs}
    bytes_up: dict[str, list[float]] = {name: [] for name in runs}
    try:
        local_verifier.wait_serving(f"127.0.0.1:{port}", proc)
        configs = {run: GenerationConfig(max_new_tokens=args.max_new_tokens, draft_len=k,
                                         ignore_eos=True, drafter=kind, stop_confidence=stop)
                   for run, (_, kind, k, stop, _) in runs.items()}
        clients = {run: EdgeClient(f"127.0.0.1:{port}", draft, protocol=protocol,
                                   rtt_ms=args.rtt_ms, intra_op_threads=1,
                                   feature_head=args.feature_head if kind == FEATURE
                                   else None)
                   for run, (protocol, kind, _, _, draft) in runs.items()}
        try:
            for prompt in prompts:  # the protocols take turns on each prompt
                outputs = []
                for name, client in clients.items():
                    gen = client.generate(_prompt_ids(client, prompt), configs[name])
                    list(gen)
                    outputs.append(gen.token_ids)
                    st = gen.stats
                    results[name].append(st.new_tokens / st.wall_s)
                    forwards[name].append(st.target_forwards / st.new_tokens)
                    bytes_down[name].append(st.bytes_down / st.new_tokens)
                    bytes_up[name].append(st.bytes_up / st.new_tokens)
                if any(out != outputs[-1] for out in outputs):
                    print(f"warning: {prompt.id}: protocols committed different text "
                          "(a near tie in the target's logits)")
        finally:
            for client in clients.values():
                client.close()
    finally:
        local_verifier.stop(proc)
    cloud = statistics.median(results["cloud"])
    report = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "draft_len": ks, "stop_confidence": stops, "rtt_ms": args.rtt_ms,
              "tokens_per_s_median": {k: statistics.median(v) for k, v in results.items()},
              "target_forwards_per_token_mean": {k: statistics.fmean(v)
                                                 for k, v in forwards.items()},
              "bytes_down_per_token_mean": {k: statistics.fmean(v)
                                            for k, v in bytes_down.items()},
              "bytes_up_per_token_mean": {k: statistics.fmean(v) for k, v in bytes_up.items()}}
    report["vs_cloud"] = {k: v / cloud for k, v in report["tokens_per_s_median"].items()}
    report["vs_cloud_paired"] = {
        k: statistics.median(a / c for a, c in zip(v, results["cloud"], strict=True))
        for k, v in results.items()}
    report["draft_dirs"] = [str(d) if d else "shipped" for d in drafts]
    for name in runs:
        print(f"{name:24s} {report['tokens_per_s_median'][name]:6.1f} tok/s (median of "
              f"{len(prompts)}), {report['vs_cloud'][name]:.2f}x cloud-only "
              f"({report['vs_cloud_paired'][name]:.2f}x paired), "
              f"{report['target_forwards_per_token_mean'][name]:.3f} target forwards/token, "
              f"{report['bytes_down_per_token_mean'][name]:.0f} B down and "
              f"{report['bytes_up_per_token_mean'][name]:.0f} B up per token")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
