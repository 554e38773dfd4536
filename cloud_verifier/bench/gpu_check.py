"""The GPU check, per engine: greedy identity, single-client and capacity figures, spec against
baseline; and the one report of both engines that deploy/gpu-check.sh writes.

    deploy/gpu-check.sh [--out FILE] [--model DIR] [--cpu-smoke] [--engines builtin,vllm]
        [--tensor-parallel-size N]

Each engine runs in its own process (``--engine builtin`` or ``--engine vllm``), in-process on
the verifier's engine (no gRPC, no draft model), and reaches no network:

- **identity**: B prompts decoded greedily by a reference and by speculative rounds through
  the engine (batched, K = 4, replayed drafts). Built-in: the reference is the target alone
  (transformers' own forward with its cache, token by token), for every attention
  implementation the device has, in float32 (TF32 off: must be identical) and, on CUDA,
  bfloat16. vLLM: the reference is vLLM's own greedy generation of the same checkpoint, in
  the serving dtype (bfloat16 on CUDA, float32 on the CPU). Where identity is only reported
  (bf16: kernels that differ in rounding may flip a near-tie) the first divergence and the
  reference's top-2 logit gap there are given;
- **single client**: tokens/s of one session, plain decoding (K = 0) against speculative
  rounds with replayed drafts accepted with probability alpha;
- **capacity**: B = 1 .. 64 sessions decoded in lockstep (every forward serves all of them),
  aggregate tokens/s and ms per forward, baseline against spec.

Replayed drafts: the baseline's own greedy continuation, each drafted token kept with
probability alpha (else replaced by a wrong one), so spec commits exactly the baseline's
tokens and the figures isolate the verifier's cost. The built-in engine without ``--model``
uses the prepared SmolLM2 checkpoint when present, else random weights of SmolLM2-135M's
shape (same FLOPs and memory traffic; said so in the JSON); vLLM loads a checkpoint from disk
itself, so it needs ``--model`` or the prepared one. ``--cpu-smoke`` runs the same code on the
CPU with few tokens (the built-in engine on a tiny random model), for the tests.

An engine that cannot run here (vLLM that does not import or start) writes a report with
status "error" and the reason instead of figures; ``--combine`` gathers the engines' reports,
and the log tail of any that wrote none, into one.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from cloud_verifier.attention import ATTENTION, check_attention
from cloud_verifier.engine import VerifierEngine
from cloud_verifier.sampling import SamplingParams
from cloud_verifier.sessions import SessionStore
from cloud_verifier.target_engine import DraftRound

log = logging.getLogger(__name__)

ENGINES = ("builtin", "vllm")
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                     num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                     max_position_embeddings=8192, tie_word_embeddings=True)
TINY_SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.4, tie_word_embeddings=False)
# vLLM's context: the longest capacity prompt (128 + 8 * 63 tokens) plus 64 new and K, with
# room; vLLM must hold one such sequence in its KV cache at start.
VLLM_CONTEXT = 2048
# Lines of an engine's log kept in the report when it ends in an error.
LOG_TAIL = 20

# decode(prompts, k, alpha, references) on one engine: the figures are the same for both.
Decode = Callable[..., dict]


def build_model(model_dir: str | None, shape: dict, device: torch.device,
                dtype: torch.dtype) -> tuple[torch.nn.Module, str]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from cloud_verifier.target_model import is_complete_checkpoint, load_target
    from shared import paths

    if model_dir or (shape is SMOLLM2_SHAPE and is_complete_checkpoint(
            paths.default_target_dir())):
        target = load_target(model_dir, str(device), str(dtype).removeprefix("torch."))
        return target.model, target.name
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape)).to(device=device, dtype=dtype).eval()
    return model, f"random weights, shape {shape['num_hidden_layers']} layers x " \
                  f"{shape['hidden_size']}"


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length + 8 * i,), generator=g).tolist() for i in range(n)]


@torch.inference_mode()
def target_alone(model, prompt: list[int], new: int) -> tuple[list[int], list[float]]:
    """Greedy tokens from transformers' own forward and cache; and each step's top-2 gap."""
    device = next(model.parameters()).device
    out = model(input_ids=torch.tensor([prompt], device=device), use_cache=True)
    tokens, gaps = [], []
    for _ in range(new):
        logits = out.logits[0, -1].float()
        top = logits.topk(2).values
        gaps.append(float(top[0] - top[1]))
        tokens.append(int(logits.argmax()))
        out = model(input_ids=torch.tensor([[tokens[-1]]], device=device),
                    past_key_values=out.past_key_values, use_cache=True)
    return tokens, gaps


def replayed(reference: list[int], done: int, k: int, alpha: float, rng: random.Random,
             vocab: int) -> list[int]:
    """K drafts from the reference continuation, each kept with probability alpha."""
    out = []
    for j in range(k):
        want = reference[done + j] if done + j < len(reference) else 3
        out.append(want if rng.random() < alpha else (want + 1) % vocab)
    return out


def decode(engine, vocab: int, sessions_prompts: list[list[int]], new: int, k: int,
           alpha: float, references: list[list[int]] | None,
           run_batch: Callable | None = None) -> dict:
    """All sessions in lockstep through ``engine.run_batch``, or through ``run_batch`` when
    given (vLLM's rounds run on the torch thread), until each has ``new`` tokens; K = 0 is
    plain decoding. Returns tokens, forwards and seconds."""
    store = SessionStore(max_sessions=len(sessions_prompts) + 1, ttl_s=3600,
                         on_close=engine.release)
    sessions = [store.create("check", SamplingParams(), p, new, frozenset())
                for p in sessions_prompts]
    rng = random.Random(0)
    forwards = 0
    sync()
    t0 = time.perf_counter()
    while live := [s for s in sessions if not s.finished]:
        rounds = []
        for s in live:
            done = s.num_generated
            kk = min(k, new - done - 1) if references else 0
            drafts = replayed(references[sessions.index(s)], done, max(kk, 0), alpha, rng,
                              vocab) if kk > 0 else []
            rounds.append((s, DraftRound(drafts, None)))
        for outcome in (run_batch or engine.run_batch)(rounds):
            if isinstance(outcome, Exception):
                raise outcome
        forwards += 1
    sync()
    seconds = time.perf_counter() - t0
    tokens = [s.committed[s.prompt_len:] for s in sessions]
    for s in sessions:
        store.close(s.id)
    return {"tokens": tokens, "forwards": forwards, "seconds": seconds,
            "tokens_per_s": sum(map(len, tokens)) / seconds, "ms_per_forward":
            1e3 * seconds / forwards}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def compare(got: list[list[int]], reference: list[tuple[list[int], list[float]]]) -> dict:
    """Spec's tokens against the reference's: how many are identical, and where the others
    first diverge, with the reference's top-2 logit gap there."""
    diverged = []
    for i, (g, (want, gaps)) in enumerate(zip(got, reference, strict=True)):
        first = next((j for j, (a, b) in enumerate(zip(g, want, strict=True)) if a != b), None)
        if first is not None:
            diverged.append({"prompt": i, "position": first,
                             "target_top2_gap": round(gaps[first], 5)})
    return {"identical": f"{len(got) - len(diverged)}/{len(got)}", "diverged": diverged}


def identity(model, vocab: int, max_context: int, device: torch.device, dtype: torch.dtype,
             n_prompts: int, length: int, new: int) -> dict:
    ps = prompts(n_prompts, length, vocab, seed=1)
    alone = [target_alone(model, p, new) for p in ps]
    refs = [tokens for tokens, _ in alone]
    out = {}
    for attention in ATTENTION:
        try:
            check_attention(attention, device)
        except ValueError:
            continue
        if attention == "varlen" and dtype == torch.float32:
            continue  # Flash Attention is half precision only
        engine = VerifierEngine(model, vocab, max_context, attention=attention)
        out[attention] = compare(decode(engine, vocab, ps, new, 4, 0.7, refs)["tokens"], alone)
    return out


def figures(dec: Decode, vocab: int, smoke: bool) -> dict:
    """single_client and capacity, the same for both engines: ``dec(prompts, k, alpha,
    references)`` decodes the prompts on the engine under test."""
    length = 16 if smoke else 128
    # Warm-up: weight packing (CPU), kernel selection and allocator growth happen once.
    warm = dec(prompts(2, length, vocab, seed=3), 0, 0, None)
    dec(prompts(2, length, vocab, seed=3), 4, 0.8, warm["tokens"])
    base_one = dec(prompts(1, length, vocab), 0, 0, None)
    refs = base_one["tokens"]
    single = {"baseline_tokens_per_s": round(base_one["tokens_per_s"], 1)}
    for alpha in (0.6, 0.8):
        spec = dec(prompts(1, length, vocab), 4, alpha, refs)
        single[f"spec_k4_alpha{alpha}"] = {
            "tokens_per_s": round(spec["tokens_per_s"], 1),
            "ratio": round(spec["tokens_per_s"] / base_one["tokens_per_s"], 3),
            "same_tokens": spec["tokens"] == refs}
    capacity = []
    for b in ([1, 2] if smoke else [1, 2, 4, 8, 16, 32, 64]):
        ps = prompts(b, length, vocab, seed=2)
        base = dec(ps, 0, 0, None)
        spec = dec(ps, 4, 0.8, base["tokens"])
        capacity.append({
            "clients": b, "baseline_tokens_per_s": round(base["tokens_per_s"], 1),
            "baseline_ms_per_forward": round(base["ms_per_forward"], 2),
            "spec_k4_alpha0.8_tokens_per_s": round(spec["tokens_per_s"], 1),
            "spec_ms_per_forward": round(spec["ms_per_forward"], 2),
            "ratio": round(spec["tokens_per_s"] / base["tokens_per_s"], 3),
            "same_tokens": spec["tokens"] == base["tokens"]})
        log.info("capacity %d clients done", b)
    return {"single_client": single, "capacity": capacity}


def header(engine: str, device: torch.device) -> dict:
    import transformers

    return {"engine": engine, "device": torch.cuda.get_device_name() if device.type == "cuda"
            else platform.processor() or "cpu", "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}


def verdict(report: dict, passed: bool) -> dict:
    report["passed"] = passed
    report["status"] = "passed" if passed else "failed"
    return report


def run(args: argparse.Namespace) -> dict:
    """The built-in engine."""
    smoke = args.cpu_smoke
    device = torch.device("cpu" if smoke or not torch.cuda.is_available() else "cuda")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    shape = TINY_SHAPE if smoke else SMOLLM2_SHAPE
    new = 6 if smoke else 64
    report = header("builtin", device)
    t_start = time.perf_counter()
    dtypes = [torch.float32] + ([torch.bfloat16] if device.type == "cuda" else [])
    report["identity"] = {}
    for dtype in dtypes:
        model, name = build_model(args.model, shape, device, dtype)
        vocab, ctx = model.config.vocab_size, model.config.max_position_embeddings
        report["model"] = name
        report["identity"][str(dtype).removeprefix("torch.")] = identity(
            model, vocab, ctx, device, dtype, 2 if smoke else 4, 8 if smoke else 48, new)
        log.info("identity %s done", dtype)
    # The figures: bf16 on CUDA (the serving dtype), fp32 on the CPU; a fresh engine (empty
    # KV store) for every run, as a fresh verifier would have.
    report.update(figures(lambda ps, k, alpha, refs: decode(
        VerifierEngine(model, vocab, ctx), vocab, ps, new, k, alpha, refs), vocab, smoke))
    report["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    # Pass/fail on what must hold exactly: fp32 identity, and in fp32 (the CPU) spec
    # committing the baseline's tokens; in bf16 the latter is reported, not required.
    fp32 = report["identity"]["float32"].values()
    return verdict(report, all(not v["diverged"] for v in fp32) and (
        device.type == "cuda" or all(c["same_tokens"] for c in report["capacity"])))


def vllm_reference(llm, ps: list[list[int]], new: int) -> list[tuple[list[int], list[float]]]:
    """vLLM's own greedy generation, and the top-2 gap of every step (its logprobs are raw
    log-softmax rows, so a gap of logprobs is the gap of logits)."""
    from vllm import SamplingParams as VllmParams
    from vllm.inputs import TokensPrompt

    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps],
                        VllmParams(max_tokens=new, temperature=0.0, ignore_eos=True,
                                   detokenize=False, logprobs=2), use_tqdm=False)
    result = []
    for o in outs:
        gaps = []
        for step in o.outputs[0].logprobs:
            top = sorted((lp.logprob for lp in step.values()), reverse=True)
            gaps.append(top[0] - top[1] if len(top) > 1 else float("inf"))
        result.append((list(o.outputs[0].token_ids), gaps))
    return result


def run_vllm(args: argparse.Namespace) -> dict:
    """vLLM (``edgespec-verifier --engine vllm``): the verifier's VllmEngine, its rounds on
    the torch thread as in the server."""
    import vllm

    from cloud_verifier import torch_thread
    from cloud_verifier.vllm_engine import VllmSettings, load_vllm_engine

    smoke = args.cpu_smoke
    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    new = 6 if smoke else 64
    report = header("vllm", device) | {"vllm": vllm.__version__, "dtype": dtype,
                                       "tensor_parallel_size": args.tensor_parallel_size}
    t_start = time.perf_counter()
    meta, engine = load_vllm_engine(args.model, VLLM_CONTEXT, VllmSettings(
        dtype=dtype, tensor_parallel_size=args.tensor_parallel_size))
    report["model"] = meta.name
    report["start_s"] = round(time.perf_counter() - t_start, 1)
    vocab = meta.vocab_size

    def dec(ps, k, alpha, refs):
        # Every run starts from an empty prefix cache, as the first did: a later run over the
        # same prompts would otherwise prefill less and look faster.
        engine.llm.reset_prefix_cache()
        return decode(engine, vocab, ps, new, k, alpha, refs,
                      run_batch=lambda rounds: torch_thread.run(engine.run_batch, rounds))

    ps = prompts(2 if smoke else 4, 8 if smoke else 48, vocab, seed=1)
    reference = torch_thread.run(vllm_reference, engine.llm, ps, new)
    report["identity"] = {dtype: compare(dec(ps, 4, 0.7, [t for t, _ in reference])["tokens"],
                                         reference)}
    log.info("identity %s done", dtype)
    report.update(figures(dec, vocab, smoke))
    report["reruns"] = engine.reruns
    report["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    # As for the built-in engine: exact where the arithmetic is fp32 (vLLM's float32 is the
    # CPU's here), reported in bf16, where vLLM's prefill of a round and its decode step of
    # the reference are different kernels.
    exact = dtype == "float32"
    return verdict(report, not exact or (not report["identity"][dtype]["diverged"] and all(
        c["same_tokens"] for c in report["capacity"])))


def check(args: argparse.Namespace) -> dict:
    try:
        return run(args) if args.engine == "builtin" else run_vllm(args)
    except Exception as err:
        # Whatever stops an engine here (vLLM not installed, built for another torch or CUDA,
        # a checkpoint missing, out of memory) is the finding: it goes into the report, and
        # the other engine's half of the check still runs.
        log.exception("the %s engine could not run", args.engine)
        return {"engine": args.engine, "status": "error", "passed": False,
                "reason": f"{type(err).__name__}: {err}"}


def combine(work: Path, engines: list[str]) -> tuple[dict, int]:
    """One report from the engines' own (``work/ENGINE.json``); an engine that wrote none
    (killed at its time limit, crashed) is an error with its exit status and log tail.
    Exit status: 0 all passed, 1 a check failed, 3 an engine could not run."""
    parts = {}
    for name in engines:
        part, logfile = work / f"{name}.json", work / f"{name}.log"
        tail = logfile.read_text(errors="replace").splitlines()[-LOG_TAIL:] \
            if logfile.is_file() else []
        if part.is_file():
            parts[name] = json.loads(part.read_text())
        else:
            rc_file = work / f"{name}.rc"
            rc = rc_file.read_text().strip() if rc_file.is_file() else "unknown"
            why = "killed at its time limit" if rc in ("124", "137") else \
                f"exited with status {rc} and no report"
            parts[name] = {"engine": name, "status": "error", "passed": False, "reason": why}
        if parts[name]["status"] == "error":
            parts[name]["log_tail"] = tail
    statuses = {p["status"] for p in parts.values()}
    code = 1 if "failed" in statuses else 3 if "error" in statuses else 0
    return {"engines": parts, "passed": code == 0}, code


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=ENGINES, default="builtin")
    p.add_argument("--out", default="gpu-check.json")
    p.add_argument("--model", default=None, help="a local checkpoint (default: see above)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="the CPU, a few tokens (for the tests)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="vLLM: GPUs the target is split over (the built-in engine uses one)")
    p.add_argument("--combine", type=Path, default=None, metavar="DIR",
                   help="write one report from DIR/ENGINE.json (and .log, .rc) of --engines")
    p.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.combine is not None:
        report, code = combine(args.combine, args.engines)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        for name, part in report["engines"].items():
            print(f"gpu-check {name}: {part['status']}"
                  + (f" ({part['reason']})" if "reason" in part else ""))
        return code
    report = check(args)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return {"passed": 0, "failed": 1}.get(report["status"], 3)


if __name__ == "__main__":
    sys.exit(main())
