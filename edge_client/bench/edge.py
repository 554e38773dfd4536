"""``edgespec-bench e2e``: the same prompts through six decoders, side by side in one run.

(a) the target alone, transformers greedy ``generate``;
(b) transformers assisted generation (``assistant_model``) with the same draft weights in
    PyTorch;
(c) edgespec: ONNX draft on the client, Verify rounds to a verifier on a loopback port;
(d) the same with an injected round-trip time (50 ms by default);
(e), (f) as (c), (d) on a Lookahead stream (the verifier decodes back to back while the
    client streams drafts ahead).

All run greedy, so (b) to (f) must reproduce (a) token for token; the report says how many
prompts matched. Target forwards are counted with a forward hook on the target for (a) and
(b), and from the verifier's per-round ``target_forwards`` for the rest. The client's draft
shares this machine's cores with the verifier. This is an offline tool: it imports torch.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger(__name__)


@dataclass
class CaseResult:
    name: str
    new_tokens: int = 0
    wall_s: float = 0.0
    target_forwards: int = 0
    round_trips: int | None = None
    accepted: int | None = None
    drafted: int | None = None
    bytes_total: int | None = None
    per_prompt_tps: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)

    def summary(self, reference: CaseResult | None) -> dict:
        tps = self.new_tokens / self.wall_s if self.wall_s else 0.0
        out = {
            "tokens_per_s": tps,
            "median_prompt_tokens_per_s": statistics.median(self.per_prompt_tps),
            "new_tokens": self.new_tokens,
            "wall_s": self.wall_s,
            "target_forwards_per_token": self.target_forwards / self.new_tokens,
            "round_trips_per_token": (None if self.round_trips is None
                                      else self.round_trips / self.new_tokens),
            "acceptance_rate": (None if not self.drafted else self.accepted / self.drafted),
            "bytes_per_token": (None if self.bytes_total is None
                                else self.bytes_total / self.new_tokens),
        }
        if reference is not None:
            out["speedup_vs_target"] = tps / (reference.new_tokens / reference.wall_s)
            out["outputs_identical_to_target"] = sum(
                a == b for a, b in zip(self.outputs, reference.outputs, strict=True))
        return out


class ForwardCounter:
    """Counts forward calls of a torch module."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.count = 0
        self._handle = module.register_forward_hook(self._hook)

    def _hook(self, *_):
        self.count += 1

    def take(self) -> int:
        n, self.count = self.count, 0
        return n


def _hf_case(name: str, target, prompts: list[list[int]], new_tokens: int, counter,
             **generate_kwargs) -> CaseResult:
    result = CaseResult(name)
    eos = target.eos_token_ids[0]
    for ids in prompts:
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = target.model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=new_tokens, do_sample=False, pad_token_id=eos,
                **generate_kwargs)
        wall = time.perf_counter() - t0
        gen = out[0, len(ids):].tolist()
        if eos in gen:
            gen = gen[:gen.index(eos) + 1]
        result.outputs.append(gen)
        result.new_tokens += len(gen)
        result.wall_s += wall
        result.per_prompt_tps.append(len(gen) / wall)
    result.target_forwards = counter.take()
    return result


def _edgespec_case(name: str, address: str, draft_dir: Path, prompts: list[list[int]],
                   new_tokens: int, draft_len: int, rtt_ms: float, counter,
                   protocol: str = "rounds") -> CaseResult:
    from edge_client.client import EdgeClient, GenerationConfig

    result = CaseResult(name, round_trips=0, accepted=0, drafted=0, bytes_total=0)
    config = GenerationConfig(max_new_tokens=new_tokens, draft_len=draft_len)
    with EdgeClient(address, draft_dir, rtt_ms=rtt_ms, protocol=protocol) as client:
        for ids in prompts:
            gen = client.generate(ids, config)
            list(gen)
            s = gen.stats
            result.outputs.append(gen.token_ids)
            result.new_tokens += s.new_tokens
            result.wall_s += s.wall_s
            result.round_trips += s.round_trips
            # The verifier's packed forward bypasses model.forward (and its hook): count the
            # forwards the server reports per round.
            result.target_forwards += s.target_forwards
            result.accepted += s.accepted
            result.drafted += s.drafted
            result.bytes_total += s.bytes_up + s.bytes_down
            result.per_prompt_tps.append(s.new_tokens / s.wall_s)
    counter.take()
    return result


def assistant_dir(draft_dir: Path) -> Path | None:
    """Case (b)'s PyTorch draft: the same weights over the target's whole vocabulary (a
    distilled draft's twin, or the stand-in's checkpoint); None when there is none."""
    from shared.paths import draft_twin_dir, standin_draft_dir, standin_draft_pt_dir

    if Path(draft_dir).resolve() == standin_draft_dir().resolve():
        return standin_draft_pt_dir()
    twin = draft_twin_dir(draft_dir)
    return twin if (twin / "config.json").is_file() else None


def run_bench(args: argparse.Namespace) -> int:
    from transformers import AutoModelForCausalLM

    from cloud_verifier import torch_thread
    from cloud_verifier.config import VerifierConfig
    from cloud_verifier.server import EmbeddedVerifier, load_served_target
    from edge_client.tokenizer import EdgeTokenizer
    from shared.paths import default_draft_dir, draft_twin_dir
    from shared.prompts import CHAT_PROMPTS

    log.setLevel(logging.INFO)  # progress of a long run, whatever --log-level says
    draft_dir = args.draft_dir or default_draft_dir()
    draft_pt_dir = args.draft_pt_dir or assistant_dir(draft_dir)
    # All of this process's torch work runs on the verifier's torch thread (its docstring).
    target = load_served_target(args.target)
    tokenizer = EdgeTokenizer(draft_dir)
    prompts = [tokenizer.encode_chat(p) for p in CHAT_PROMPTS[:args.prompts]]
    counter = ForwardCounter(target.model)
    k, n = args.draft_len, args.max_new_tokens

    # Warm-up, so that no case pays first-call costs.
    torch_thread.run(_hf_case, "warmup", target, prompts[:1], 4, counter)
    counter.take()

    cases: list[CaseResult] = []
    log.info("(a) target alone")
    cases.append(torch_thread.run(_hf_case, "a_target_generate", target, prompts, n, counter))
    if draft_pt_dir is None:
        log.warning("(b) skipped: no full-vocabulary PyTorch copy of %s (edgespec-distill "
                    "export writes one to %s; or pass --draft-pt-dir)", draft_dir,
                    draft_twin_dir(draft_dir))
    else:
        log.info("(b) assisted generation with %s", draft_pt_dir)
        assistant = torch_thread.run(AutoModelForCausalLM.from_pretrained, draft_pt_dir,
                                     dtype=target.dtype).eval()
        draft_counter = ForwardCounter(assistant)
        assisted = torch_thread.run(_hf_case, "b_hf_assisted", target, prompts, n, counter,
                                    assistant_model=assistant, num_assistant_tokens=k,
                                    num_assistant_tokens_schedule="constant",
                                    assistant_confidence_threshold=0.0)
        # Each assistant forward drafts one token; each target forward commits the accepted
        # drafts plus one token, so accepted = new tokens - target forwards.
        assisted.drafted = draft_counter.take()
        assisted.accepted = assisted.new_tokens - assisted.target_forwards
        cases.append(assisted)
    with EmbeddedVerifier(target, VerifierConfig(port=0)) as verifier:
        log.info("(c) edgespec over loopback")
        cases.append(_edgespec_case("c_edgespec_loopback", verifier.address, draft_dir,
                                    prompts, n, k, 0.0, counter))
        log.info("(d) edgespec with %g ms RTT", args.rtt_ms)
        cases.append(_edgespec_case(f"d_edgespec_rtt{args.rtt_ms:g}ms", verifier.address,
                                    draft_dir, prompts, n, k, args.rtt_ms, counter))
        log.info("(e) edgespec lookahead over loopback")
        cases.append(_edgespec_case("e_lookahead_loopback", verifier.address, draft_dir,
                                    prompts, n, k, 0.0, counter, protocol="lookahead"))
        log.info("(f) edgespec lookahead with %g ms RTT", args.rtt_ms)
        cases.append(_edgespec_case(f"f_lookahead_rtt{args.rtt_ms:g}ms", verifier.address,
                                    draft_dir, prompts, n, k, args.rtt_ms, counter,
                                    protocol="lookahead"))

    reference = cases[0]
    report = {
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "torch_threads": torch.get_num_threads(), "device": str(target.device)},
        "config": {"prompts": len(prompts), "max_new_tokens": n, "draft_len": k,
                   "rtt_ms": args.rtt_ms, "target": target.name, "draft_dir": str(draft_dir),
                   "assistant_dir": None if draft_pt_dir is None else str(draft_pt_dir),
                   "mode": "greedy"},
        "cases": {c.name: c.summary(None if c is reference else reference) for c in cases},
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(format_table(report))
    return 0


def format_table(report: dict) -> str:
    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    lines = ["| case | tokens/s | x target | target fwd/token | round trips/token | "
             "acceptance | bytes/token | identical |",
             "|---|---|---|---|---|---|---|---|"]
    n = report["config"]["prompts"]
    for name, c in report["cases"].items():
        lines.append(
            f"| {name} | {c['tokens_per_s']:.1f} | {fmt(c.get('speedup_vs_target', 1.0), '.2f')}"
            f" | {c['target_forwards_per_token']:.2f} | {fmt(c['round_trips_per_token'], '.2f')}"
            f" | {fmt(c['acceptance_rate'], '.2f')} | {fmt(c['bytes_per_token'], '.0f')} | "
            f"{c.get('outputs_identical_to_target', n)}/{n} |")
    return "\n".join(lines)
