"""``edgespec-distill``: distil the target into a small ONNX draft, resumably.

Subcommands (each one checkpoints; kill it at any moment and rerun the same command):
``gen-prompts`` (module ``magpie``), ``corpus`` (``corpus``: prompts and data at scale, in
bounded chunks), ``gen-data`` (module ``data``), ``train`` (``train``), ``export``
(``export``), ``eval`` (``evaluate``), ``import-onnx`` (``onnx_import``: a shipped ONNX draft
back into a run dir for ``train --init-from``), ``expand`` (``expand``: a deeper draft from a
run, same logits), and for the draft head conditioned on the
target's hidden state ``train-head`` (``head_train``), ``export-head`` (``head_export``),
``prompt-features`` (``head_context``) and ``layer-features`` (``head_layers``); the package
docstring says what each does. A stage's module is imported when its subcommand
runs, and none imports torch at module level, so ``--help`` and ``--version`` load no torch.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path

from edge_client.tools.distill.common import add_engine_arguments
from edge_client.tools.distill.prompts import SPLITS

log = logging.getLogger("edgespec.distill")


def _parse_layers(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip()) if text else ()


def parse_args(argv: Sequence[str] | None):
    p = argparse.ArgumentParser(prog="edgespec-distill", description=__doc__.split("\n")[0])
    p.add_argument("--version", action="version", version=f"edgespec {version('edgespec')}")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="cmd", required=True)

    from edge_client.tools.distill.corpus import add_parser as add_corpus
    from edge_client.tools.distill.magpie import add_parser as add_gen_prompts

    add_gen_prompts(sub)
    add_corpus(sub)
    g = sub.add_parser("gen-data", help="record the target's top-k distributions")
    g.add_argument("--out", type=Path, required=True)
    g.add_argument("--target", type=Path, default=None)
    g.add_argument("--split", choices=SPLITS, default="train")
    g.add_argument("--prompts-file", type=Path, default=None,
                   help="JSONL prompts (e.g. from gen-prompts) instead of --split")
    g.add_argument("--shard-size", type=int, default=64)
    g.add_argument("--batch-size", type=int, default=16)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--top-k", type=int, default=64)
    g.add_argument("--sample-fraction", type=float, default=0.5,
                   help="share of prompts continued by sampling (the rest greedy)")
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-prompts", type=int, default=0)
    g.add_argument("--threads", type=int, default=0)
    g.add_argument("--worker", default="0/1",
                   help="i/n: run as worker i of n parallel processes (disjoint shards)")
    g.add_argument("--features", action="store_true",
                   help="also record the target's last hidden state at every decision "
                        "(for drafts conditioned on it)")
    g.add_argument("--draft-run", type=Path, default=None,
                   help="on-policy data: this training run's draft writes the continuations, "
                        "the target labels them")
    add_engine_arguments(g)

    t = sub.add_parser("train", help="distil a draft (resumes from <run-dir>/ckpt.pt)")
    t.add_argument("--run-dir", type=Path, required=True)
    t.add_argument("--data", type=Path, nargs="+", required=True, help="gen-data dirs")
    t.add_argument("--init-from", type=Path, default=None,
                   help="start from this finished run's architecture, vocabulary and weights")
    t.add_argument("--heldout", type=Path, default=None, help="gen-data dir of held-out prompts")
    t.add_argument("--target", type=Path, default=None)
    t.add_argument("--init", choices=["scratch", "pca", "target"], default="scratch")
    t.add_argument("--hidden", type=int, default=256)
    t.add_argument("--layers", type=int, default=4)
    t.add_argument("--heads", type=int, default=4)
    t.add_argument("--kv-heads", type=int, default=2)
    t.add_argument("--intermediate", type=int, default=768)
    t.add_argument("--target-layers", type=_parse_layers, default=(),
                   help="init=target: comma-separated target layers to copy, e.g. 0,1,2,29")
    t.add_argument("--sub-vocab", type=int, default=16384, help="0: the full vocabulary")
    t.add_argument("--steps", type=int, default=2000)
    t.add_argument("--batch-size", type=int, default=16)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--warmup", type=int, default=50)
    t.add_argument("--tv-weight", type=float, default=1.0)
    t.add_argument("--max-len", type=int, default=320)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--ckpt-every-s", type=float, default=300.0)
    t.add_argument("--ckpt-every-steps", type=int, default=0)
    t.add_argument("--eval-every", type=int, default=200)
    t.add_argument("--eval-samples", type=int, default=64)
    t.add_argument("--log-every", type=int, default=10)
    t.add_argument("--threads", type=int, default=0)
    t.add_argument("--lr-steps", type=int, default=0,
                   help="cosine horizon (default --steps); fix it to extend a run unchanged")

    e = sub.add_parser("export", help="ONNX + int8 + MODEL_CARD.md from a run's checkpoint")
    e.add_argument("--run-dir", type=Path, required=True)
    e.add_argument("--out", type=Path, required=True)
    e.add_argument("--heldout", type=Path, default=None)
    e.add_argument("--target", type=Path, default=None)
    e.add_argument("--fp32-out", type=Path, default=None)
    e.add_argument("--eval-samples", type=int, default=0)
    e.add_argument("--no-quantize", action="store_true")
    e.add_argument("--no-target-timing", action="store_true")
    e.add_argument("--threads", type=int, default=0)
    e.add_argument("--share-embedding", action="store_true",
                   help="one quantized table for the embedding and the tied LM head")
    e.add_argument("--int4", nargs="+", default=[], metavar="PATTERN",
                   help="4-bit weight-only MatMulNBits for the MatMuls whose names contain a "
                        "PATTERN (e.g. mlp/gate_proj mlp/up_proj mlp/down_proj lm_head)")
    e.add_argument("--int4-block", type=int, choices=(16, 32, 64, 128), default=32)
    e.add_argument("--graph", choices=("traced", "fused"), default="traced",
                   help="traced: optimum's export; fused: onnxruntime's fused attention and "
                        "norm operators, a dozen nodes a layer (edge_client/tools/fused_graph.py)")
    e.add_argument("--int4-accuracy", type=int, choices=(0, 1, 2, 3, 4), default=4,
                   help="MatMulNBits accuracy_level (4: int8 activations, the faster on the "
                        "2-core VM; 0: fp32)")

    i = sub.add_parser("import-onnx", help="a shipped ONNX draft dir (traced or fused graph; "
                                           "int8, 4-bit or fp32) back into a finished run dir "
                                           "for train --init-from")
    i.add_argument("--draft", type=Path, required=True, help="dir with model.onnx + config.json")
    i.add_argument("--out", type=Path, required=True, help="the run dir to write")
    i.add_argument("--target", type=Path, default=None)
    i.add_argument("--check-tokens", type=int, default=64,
                   help="random ids to compare torch and ONNX logits on (0: skip)")
    i.add_argument("--threads", type=int, default=0)

    x = sub.add_parser("expand", help="a deeper draft from a finished run: new layers whose "
                                      "output projections start at zero (the same logits), "
                                      "for train --init-from")
    x.add_argument("--from", dest="source", type=Path, required=True, help="a finished run dir")
    x.add_argument("--out", type=Path, required=True, help="the run dir to write")
    x.add_argument("--insert-after", type=int, nargs="+", required=True, metavar="LAYER",
                   help="a new layer after each of these source layers (0-based)")

    _add_head_parsers(sub)
    v = sub.add_parser("eval", help="held-out acceptance of a run or an ONNX draft dir")
    v.add_argument("what", type=Path, help="a run dir (ckpt.pt) or an ONNX draft dir")
    v.add_argument("--heldout", type=Path, required=True)
    v.add_argument("--target", type=Path, default=None)
    v.add_argument("--eval-samples", type=int, default=0)
    v.add_argument("--threads", type=int, default=0)
    return p.parse_args(argv)


def _add_head_parsers(sub) -> None:
    h = sub.add_parser("train-head", help="train a feature head on gen-data --features data "
                                          "(resumes from <run-dir>/ckpt.pt)")
    h.add_argument("--run-dir", type=Path, required=True)
    h.add_argument("--data", type=Path, nargs="+", required=True,
                   help="gen-data --features dirs")
    h.add_argument("--heldout", type=Path, default=None,
                   help="gen-data --features dir of held-out prompts")
    h.add_argument("--target", type=Path, default=None)
    h.add_argument("--sub-vocab", type=int, default=8192, help="0: the full vocabulary")
    h.add_argument("--intermediate", type=int, default=1536, help="the layer's MLP width")
    h.add_argument("--max-chain", type=int, default=32,
                   help="chain positions the runtime accepts")
    h.add_argument("--chain-len", type=int, default=6, help="unrolled training chain steps")
    h.add_argument("--steps", type=int, default=2000)
    h.add_argument("--batch-size", type=int, default=32, help="chains per step")
    h.add_argument("--lr", type=float, default=1e-3)
    h.add_argument("--warmup", type=int, default=50)
    h.add_argument("--tv-weight", type=float, default=1.0)
    h.add_argument("--feature-weight", type=float, default=1.0)
    h.add_argument("--seed", type=int, default=0)
    h.add_argument("--ckpt-every-s", type=float, default=300.0)
    h.add_argument("--ckpt-every-steps", type=int, default=0)
    h.add_argument("--eval-every", type=int, default=200)
    h.add_argument("--eval-samples", type=int, default=64)
    h.add_argument("--log-every", type=int, default=10)
    h.add_argument("--threads", type=int, default=0)
    h.add_argument("--lr-steps", type=int, default=0,
                   help="cosine horizon (default --steps); fix it to extend a run unchanged")
    h.add_argument("--feature-codec", default="fp16",
                   help="the wire form of the features the verifier sends (shared.feature_codec: "
                        "fp16 or int8-g<G>); the head trains on its round trip")
    h.add_argument("--context", action="store_true",
                   help="a context head (head_context): attends over the target's features of "
                        "the whole text; needs prompt features (gen-data --features writes "
                        "them, prompt-features backfills older data); --batch-size counts "
                        "sequences")
    h.add_argument("--passes", type=int, default=3,
                   help="context heads: unrolled draft steps trained (training-time test)")
    h.add_argument("--max-len", type=int, default=256,
                   help="context heads: pairs per training sequence at most")
    h.add_argument("--feature-layers", default="",
                   help="context heads: decoder layers (e.g. 2,15,27) whose outputs are fused "
                        "with the final-norm feature (EAGLE-3); layer-features writes them")

    lf = sub.add_parser("layer-features", help="the target's states at some decoder layers for "
                                               "every position of gen-data --features shards")
    lf.add_argument("--data", type=Path, nargs="+", required=True)
    lf.add_argument("--layers", required=True, help="comma-separated decoder layers, e.g. 2,15,27")
    lf.add_argument("--target", type=Path, default=None)
    lf.add_argument("--batch-size", type=int, default=8)
    lf.add_argument("--threads", type=int, default=0)

    f = sub.add_parser("prompt-features", help="backfill the target's features at every prompt "
                                               "position of gen-data --features shards")
    f.add_argument("--data", type=Path, nargs="+", required=True)
    f.add_argument("--target", type=Path, default=None)
    f.add_argument("--batch-size", type=int, default=8)
    f.add_argument("--threads", type=int, default=0)

    x = sub.add_parser("export-head", help="ONNX + int8 + MODEL_CARD.md + feature_head.json "
                                           "from a train-head run")
    x.add_argument("--run-dir", type=Path, required=True)
    x.add_argument("--out", type=Path, required=True)
    x.add_argument("--heldout", type=Path, default=None)
    x.add_argument("--target", type=Path, default=None)
    x.add_argument("--eval-samples", type=int, default=0)
    x.add_argument("--no-quantize", action="store_true")
    x.add_argument("--keep-fp32", default="down_proj,lm_head",
                   help="comma-separated MatMul name parts kept at fp32 activations "
                        "(int8 weights only)")
    x.add_argument("--no-target-timing", action="store_true")
    x.add_argument("--threads", type=int, default=0)


def _run_head(args) -> None:
    if args.cmd == "train-head":
        from edge_client.tools.distill.head_layers import parse_layers
        from edge_client.tools.distill.head_model import HeadArch
        from edge_client.tools.distill.head_train import HeadTrainConfig, train_head

        train_head(HeadTrainConfig(
            args.run_dir, args.data, args.heldout, args.target,
            HeadArch(args.sub_vocab, args.intermediate, args.max_chain,
                     parse_layers(args.feature_layers) if args.feature_layers else ()),
            steps=args.steps,
            batch_size=args.batch_size, chain_len=args.chain_len, lr=args.lr,
            warmup=args.warmup, tv_weight=args.tv_weight, feature_weight=args.feature_weight,
            seed=args.seed, ckpt_every_s=args.ckpt_every_s,
            ckpt_every_steps=args.ckpt_every_steps, eval_every=args.eval_every,
            eval_samples=args.eval_samples, threads=args.threads, log_every=args.log_every,
            lr_steps=args.lr_steps, feature_codec=args.feature_codec, context=args.context,
            passes=args.passes, max_len=args.max_len))
    elif args.cmd == "prompt-features":
        from edge_client.tools.distill.common import default_target
        from edge_client.tools.distill.head_context import backfill_prompt_features

        target = args.target or default_target()
        for d in args.data:
            print(json.dumps({"data": str(d), **backfill_prompt_features(
                d, target, args.batch_size, args.threads)}))
    elif args.cmd == "layer-features":
        from edge_client.tools.distill.common import default_target
        from edge_client.tools.distill.head_layers import backfill_layer_features, parse_layers

        target, layers = args.target or default_target(), parse_layers(args.layers)
        for d in args.data:
            print(json.dumps({"data": str(d), **backfill_layer_features(
                d, target, layers, args.batch_size, args.threads)}))
    else:
        from edge_client.tools.distill.common import jsonable
        from edge_client.tools.distill.head_export import HeadExportConfig, export_head

        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        res = export_head(HeadExportConfig(args.run_dir, args.out, args.heldout, args.target,
                                           args.eval_samples, not args.no_quantize,
                                           tuple(p for p in args.keep_fp32.split(",") if p),
                                           measure_target=not args.no_target_timing))
        print(json.dumps(jsonable(res), indent=2))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return _run(args)
    except ValueError as exc:  # bad settings: say so in one line
        log.error("%s", exc)
        return 2


def _run(args) -> int:
    from edge_client.tools.distill.common import jsonable

    if args.cmd == "gen-data":
        from edge_client.tools.distill.data import GenConfig, gen_data

        gen_data(GenConfig(args.target, args.out, args.split, args.shard_size, args.batch_size,
                           args.max_new_tokens, args.top_k, args.sample_fraction,
                           args.temperature, args.seed, args.max_prompts, args.threads,
                           *map(int, args.worker.split("/")), draft_run=args.draft_run,
                           prompts_file=args.prompts_file, features=args.features,
                           engine=args.engine, dtype=args.dtype))
    elif args.cmd == "gen-prompts":
        from edge_client.tools.distill.magpie import run_cli

        return run_cli(args)
    elif args.cmd == "corpus":
        from edge_client.tools.distill import corpus

        return corpus.run_cli(args)
    elif args.cmd == "train":
        from edge_client.tools.distill.model import ArchConfig
        from edge_client.tools.distill.train import TrainConfig, train

        arch = ArchConfig(args.init, args.hidden, args.layers, args.heads, args.kv_heads,
                          args.intermediate, args.target_layers, args.sub_vocab)
        train(TrainConfig(args.run_dir, args.data, args.heldout, args.target, arch, args.steps,
                          args.batch_size, args.lr, warmup=args.warmup,
                          tv_weight=args.tv_weight, max_len=args.max_len, seed=args.seed,
                          ckpt_every_s=args.ckpt_every_s, ckpt_every_steps=args.ckpt_every_steps,
                          eval_every=args.eval_every, eval_samples=args.eval_samples,
                          threads=args.threads, log_every=args.log_every,
                          lr_steps=args.lr_steps, init_from=args.init_from))
    elif args.cmd == "export":
        from edge_client.tools.distill.export import ExportConfig, export

        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        res = export(ExportConfig(args.run_dir, args.out, args.heldout, args.target,
                                  args.fp32_out, args.eval_samples, not args.no_quantize,
                                  measure_target=not args.no_target_timing,
                                  share_embedding=args.share_embedding, int4=tuple(args.int4),
                                  int4_block=args.int4_block,
                                  int4_accuracy=args.int4_accuracy, graph=args.graph))
        print(json.dumps(jsonable(res), indent=2))
    elif args.cmd == "import-onnx":
        from edge_client.tools.distill.onnx_import import import_onnx

        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        res = import_onnx(args.draft, args.out, args.target, args.check_tokens)
        print(json.dumps(jsonable({k: v for k, v in res.items() if k != "sources"}), indent=2))
    elif args.cmd == "expand":
        from edge_client.tools.distill.expand import expand_run

        print(json.dumps(expand_run(args.source, args.out, args.insert_after), indent=2))
    elif args.cmd in ("train-head", "export-head", "prompt-features", "layer-features"):
        _run_head(args)
    elif args.cmd == "eval":
        from edge_client.tools.distill.evaluate import eval_command

        print(json.dumps(jsonable(eval_command(args.what, args.heldout, args.target,
                                                args.eval_samples, args.threads)), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
