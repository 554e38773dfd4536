"""The restart drill: kill -9 the verifier in the middle of a generation, start it again on
the same address after a pause, and check that the generation finishes with exactly the
output of an undisturbed run.

    python -m edge_client.bench.restart_drill --down-s 0 10 30 --json drill.json

Each case is (protocol, decoding, pause): greedy on Verify rounds and on the lookahead
stream, and seeded sampling on Verify rounds (the lookahead's sampled output depends on
which drafts arrive in time, so only its law, not its tokens, is a function of the seed).
The reference output comes from an undisturbed run of the same case on the same verifier.
The verifier runs as its own process (``python -m cloud_verifier.server``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from edge_client import local_verifier
from edge_client.client import EdgeClient, GenerationConfig
from edge_client.connection import RetryPolicy

log = logging.getLogger(__name__)
PROMPT = "Explain how a bicycle stays upright, in a few sentences."


@dataclass(frozen=True)
class Case:
    protocol: str
    temperature: float
    down_s: float

    @property
    def name(self) -> str:
        mode = "greedy" if self.temperature == 0 else f"T={self.temperature}"
        return f"{self.protocol}/{mode}/down {self.down_s:g} s"


class Verifier:
    """One verifier process on a fixed port, which the drill kills and restarts."""

    def __init__(self, model: str | None, port: int) -> None:
        self.model, self.port = model, port
        self.address = f"127.0.0.1:{port}"
        self.proc = local_verifier.spawn(port, model)
        self.startup_s = local_verifier.wait_serving(self.address, self.proc)

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def restart(self) -> None:
        self.proc = local_verifier.spawn(self.port, self.model)

    def ensure_serving(self) -> None:
        local_verifier.wait_serving(self.address, self.proc)

    def stop(self) -> None:
        local_verifier.stop(self.proc)


def generate(client: EdgeClient, prompt: str, config: GenerationConfig,
             on_tokens=None) -> tuple[list, dict]:
    gen = client.generate(prompt, config)
    for _ in gen:
        if on_tokens is not None:
            on_tokens(len(gen.token_ids))
    return list(gen.token_ids), gen.stats.to_dict()


def run_case(verifier: Verifier, draft_dir: Path | None, case: Case, tokens: int,
             kill_after: int, rtt_ms: float, prompt: str = PROMPT) -> dict:
    config = GenerationConfig(max_new_tokens=tokens, temperature=case.temperature,
                              top_p=0.95 if case.temperature else 1.0, seed=11,
                              ignore_eos=True)
    retry = RetryPolicy(budget_s=case.down_s + verifier.startup_s * 3 + 60)
    with EdgeClient(verifier.address, draft_dir, protocol=case.protocol, rtt_ms=rtt_ms,
                    retry=retry) as client:
        reference, _ = generate(client, prompt, config)
        killed_at: list[float] = []
        timers: list[threading.Timer] = []

        def maybe_kill(n: int) -> None:
            if n >= kill_after and not killed_at:
                killed_at.append(time.perf_counter())
                verifier.kill()
                timers.append(threading.Timer(case.down_s, verifier.restart))
                timers[-1].start()

        t0 = time.perf_counter()
        try:
            disturbed, stats = generate(client, prompt, config, maybe_kill)
            error = None
        except Exception as err:  # noqa: BLE001 - a failed run is a result of the drill
            disturbed, stats, error = [], {}, f"{type(err).__name__}: {err}"
        wall_s = time.perf_counter() - t0
    # A run that ends before the pause is over (on a loaded machine the last tokens can come
    # in one burst after the kill) must still see the restart happen here; otherwise the
    # check below reads the killed process, and the late restart leaves an orphan verifier.
    for timer in timers:
        timer.join()
    verifier.ensure_serving()
    return {"case": case.name, "protocol": case.protocol, "temperature": case.temperature,
            "down_s": case.down_s, "killed": bool(killed_at), "identical": disturbed == reference,
            "tokens": len(disturbed), "reference_tokens": len(reference), "error": error,
            "reopens": stats.get("reopens"), "wall_s": round(wall_s, 2),
            "backoff_s": round(stats.get("backoff_s", 0.0), 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="restart_drill", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="target checkpoint (default: prepared)")
    p.add_argument("--draft-dir", type=Path, default=None)
    p.add_argument("--down-s", type=float, nargs="+", default=[0.0, 10.0, 30.0],
                   help="pauses between the kill and the restart")
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--kill-after", type=int, default=24, help="tokens received before the kill")
    p.add_argument("--rtt-ms", type=float, default=20.0)
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--json", type=Path, default=None, metavar="PATH")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    verifier = Verifier(args.model, local_verifier.free_port())
    results = []
    try:
        for down in args.down_s:
            for protocol, temperature in (("rounds", 0.0), ("lookahead", 0.0), ("rounds", 0.7)):
                result = run_case(verifier, args.draft_dir, Case(protocol, temperature, down),
                                  args.tokens, args.kill_after, args.rtt_ms, args.prompt)
                results.append(result)
                print(json.dumps(result), flush=True)
    finally:
        verifier.stop()
    summary = {"runs": len(results), "identical": sum(r["identical"] for r in results),
               "killed": sum(r["killed"] for r in results),
               "verifier_startup_s": round(verifier.startup_s, 2), "results": results}
    print(f"restart drill: {summary['identical']}/{summary['runs']} runs finished identical "
          f"({summary['killed']} killed mid-generation)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if summary["identical"] == summary["runs"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
