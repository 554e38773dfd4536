"""Sampling parameters and the target distribution p they define (torch, used by the verifier).

``target_probs`` turns target logits into the distribution the verifier treats as "the target":
speculative sampling is lossless with respect to exactly this p. The order of operations is

1. temperature: logits / T (T = 0 means greedy, see below);
2. top-k: keep the k largest logits (k = 0 disables);
3. top-p (nucleus): keep the smallest set of most probable tokens, taken in descending order,
   whose cumulative probability reaches top_p, renormalising after top-k first; the most
   probable token is always kept, and the token that crosses top_p is kept (top_p = 1 disables);
4. softmax over what is left.

This is the order transformers' ``generate`` applies its temperature, top-k and top-p warpers.

Tie rule, the same everywhere: among equal values the lowest token id wins. Greedy decoding
returns a one-hot of ``torch.argmax`` (which picks the first maximum); top-k and top-p rank
tokens with a stable descending sort, so a cut that falls inside a run of equal logits keeps
the lower ids. transformers differs on ties (its top-k keeps every token equal to the k-th
logit, and its top-p order among equal probabilities is unspecified); we pin one rule so that
``edge_client.sampling`` (numpy, on the device) computes exactly the same truncation.

All arithmetic is float32 whatever the input dtype. ``+inf`` logits are clamped to the
largest float32 (so a row of several ``+inf`` splits evenly among them), ``-inf`` logits get
probability 0, and logits are shifted by their row maximum before the temperature divides
them, so huge logits do not overflow. A row with no finite logit, or with a NaN, is rejected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cloud_verifier.device_copy import to_device

_F32_MAX = torch.finfo(torch.float32).max
SEED_LIMIT = 2**64  # the protocol's uint64: every value it can carry is a seed


@dataclass(frozen=True)
class SamplingParams:
    """How the target's next-token distribution is shaped. temperature = 0 is greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    def validate(self) -> None:
        """Raises ValueError naming the first field that is out of range."""
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) \
                or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {p!r}")
        s = self.seed
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < SEED_LIMIT:
            raise ValueError(f"seed must be an integer in [0, 2**64), got {s!r}")


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits ``[N, V]`` -> float32 probabilities ``[N, V]``, processed as the module says."""
    probs, valid = target_probs_rows(logits, [params] * logits.shape[0] if logits.dim() == 2
                                     else [params])
    if not bool(valid.all()):
        raise ValueError("every logits row needs a finite maximum: a row is all -inf or has NaN")
    return probs


def target_probs_rows(logits: torch.Tensor, params: list[SamplingParams]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Row r of logits ``[N, V]`` shaped by ``params[r]``: float32 probabilities ``[N, V]`` and
    ``valid`` ``[N]`` (bool), False where a row has no finite maximum or a NaN (its
    probabilities are then meaningless). Draws no host sync: the batched verifier reads
    ``valid`` with its decisions. Each row gets exactly the numbers ``target_probs`` gives it
    alone (rows are independent; those without top-k or top-p skip the sort, as alone)."""
    for sp in dict.fromkeys(params):  # each distinct params once (rows share them)
        sp.validate()
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must have shape [N, V] with V > 0, got {tuple(logits.shape)}")
    if len(params) != logits.shape[0]:
        raise ValueError(f"{len(params)} sampling params for {logits.shape[0]} logits rows")
    device = logits.device
    x = logits.float().clamp(max=_F32_MAX)  # [N, V]; +inf -> largest float, NaN stays NaN
    row_max = x.max(dim=1, keepdim=True).values  # [N, 1]; NaN if the row has a NaN
    valid = torch.isfinite(row_max[:, 0])  # [N]
    vocab = x.shape[1]
    greedy = [i for i, sp in enumerate(params) if sp.is_greedy]
    cut = [i for i, sp in enumerate(params)
           if not sp.is_greedy and (0 < sp.top_k < vocab or sp.top_p < 1)]
    plain = [i for i, sp in enumerate(params)
             if not sp.is_greedy and not (0 < sp.top_k < vocab or sp.top_p < 1)]
    # Greedy rows divide by 1 here and are replaced by their one-hot below.
    temperature = to_device([sp.temperature or 1.0 for sp in params], device,
                            torch.float32)[:, None]  # [N, 1]
    # Shift first: every value becomes <= 0 (or -inf), so dividing by a tiny T cannot give NaN.
    z = (x - row_max) / temperature  # [N, V]
    # One kind of row (the usual case: sessions share their settings' shape): no gather.
    if len(plain) == len(params):
        return torch.softmax(z, dim=1), valid
    if len(cut) == len(params):
        return _truncated_probs(z, params), valid
    out = torch.empty_like(z)
    if plain:
        rows = to_device(plain, device)
        out[rows] = torch.softmax(z[rows], dim=1)
    if cut:
        rows = to_device(cut, device)
        out[rows] = _truncated_probs(z[rows], [params[i] for i in cut])
    if greedy:
        rows = to_device(greedy, device)
        out[rows] = torch.zeros_like(x[rows]).scatter_(1, x[rows].argmax(dim=1, keepdim=True),
                                                       1.0)
    return out, valid


def _truncated_probs(z: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Top-k, then top-p, then softmax of the tempered logits ``z`` ``[N, V]``, per row."""
    device, vocab = z.device, z.shape[1]
    sorted_z, order = torch.sort(z, dim=1, descending=True, stable=True)  # [N, V] each
    top_k = [sp.top_k if 0 < sp.top_k < vocab else vocab for sp in params]
    if any(k < vocab for k in top_k):
        keep = torch.arange(vocab, device=device)[None, :] < to_device(top_k, device)[:, None]
        sorted_z = sorted_z.masked_fill(~keep, -math.inf)
    if any(sp.top_p < 1 for sp in params):
        # top_p = 1 is off: +inf is never reached, as alone the row is not cut at all.
        top_p = to_device([sp.top_p if sp.top_p < 1 else math.inf for sp in params], device,
                          torch.float32)[:, None]  # [N, 1]
        sorted_p = torch.softmax(sorted_z, dim=1)
        # Mass strictly before each position; position 0 sees 0 < top_p and is always kept.
        before = torch.zeros_like(sorted_p)
        before[:, 1:] = sorted_p.cumsum(dim=1)[:, :-1]
        sorted_z = sorted_z.masked_fill(before >= top_p, -math.inf)
    sorted_probs = torch.softmax(sorted_z, dim=1)
    return torch.empty_like(sorted_probs).scatter_(1, order, sorted_probs)
