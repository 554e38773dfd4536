"""``gen-prompts --engine vllm``: the rounds of ``magpie`` sampled on vLLM (the vllm extra).

A round's sampling calls (a batch of user turns; for multiturn also the answers and the
follow-ups) each go to vLLM as one ``generate`` of token-id prompts, which vLLM batches
continuously: a finished turn's slot goes to the next request at once, where the built-in
engine decodes a left-padded batch until its longest row ends. vLLM is started as ``gen-data
--engine vllm`` starts it (``data_vllm.VllmWriter``, with its ``--dtype``) and the parameters
are built the same way.

Seeds: request k of a round (counted across the round's calls) gets the vLLM seed
``request_seed(round seed, k)``, so what a round samples depends on the round alone, not on the
rounds before it in the process; a resumed run therefore samples the rounds it has left as a
straight run would, within what vLLM keeps deterministic (the same requests, the same batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge_client.tools.distill.turn_sampling import TurnSampler


@dataclass
class _Draws:
    """A round's seed and how many requests the round has sent so far."""

    seed: int
    sent: int = 0


class VllmTurnSampler(TurnSampler):
    """The rounds' sampler on vLLM; ``writer`` a running ``VllmWriter`` (default: start one)."""

    def __init__(self, cfg, writer: Any = None) -> None:
        from edge_client.tools.distill.common import default_target
        from edge_client.tools.distill.data_vllm import VllmWriter

        self.writer = writer or VllmWriter.start(cfg.target, cfg.dtype, cfg.threads)
        target_dir = Path(cfg.target) if cfg.target is not None else default_target()
        super().__init__(cfg, target_dir, self.writer.eos)

    def draws(self, seed: int) -> _Draws:
        return _Draws(seed)

    def sample(self, prompts, max_new: int, temperature: float, draws: _Draws
               ) -> list[tuple[list[int], bool]]:
        from vllm.inputs import TokensPrompt

        from edge_client.tools.distill.data_vllm import request_seed

        stop, params = sorted(self.stop), []
        for ids in prompts:
            params.append(self.writer.params(
                list(ids), max_new, temperature, request_seed(draws.seed, draws.sent), stop,
                name=f"request {draws.sent} of round {draws.seed}", top_p=self.cfg.top_p))
            draws.sent += 1
        outputs = self.writer.llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        return [self._turn(out.outputs[0]) for out in outputs]

    def _turn(self, completion: Any) -> tuple[list[int], bool]:
        """The built-in engine's shape: the ids without the stop token, and whether one came.
        vLLM returns the stop token among the ids and says "stop" as the finish reason
        ("length" where ``max_tokens`` or the context ended it)."""
        ids = list(completion.token_ids)
        done = completion.finish_reason == "stop"
        self.tokens += len(ids)
        if done and ids and ids[-1] in self.stop:
            ids = ids[:-1]
        return ids, done
