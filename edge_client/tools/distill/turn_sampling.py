"""Sampling turns from the target for ``gen-prompts`` (module ``magpie``).

Where a user turn starts is read off the chat template rather than written down per model:
a conversation whose next user message is a marker is rendered, and everything before the
marker is the prefix from which the target writes a user turn (for SmolLM2: its default system
message, then ``<|im_start|>user\\n``). What follows the marker, if it begins with a special
token, is the end-of-turn token that stops sampling. The same rule gives the prefix of a
follow-up turn after an answer, so any template works, the tests' trivial one included.

``TurnSampler`` holds those facts for the rounds of ``magpie`` and leaves the sampling itself
to an engine: the built-in one (``magpie``) runs ``sample_batch``, left-padded batched decoding
with a KV cache (as ``data`` does), with temperature and nucleus (top-p) sampling, where
finished rows leave the batch, so a batch costs about as many forwards as its longest row;
vLLM's (``magpie_vllm``) batches continuously.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

MARK = "\ue000edgespec-next-turn\ue000"  # private-use characters: no template writes these


def render(tok, messages: Sequence[dict], add_generation_prompt: bool) -> str:
    """The chat template rendered as ``EdgeTokenizer.apply_chat_template`` renders it."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if not tok.chat_template:
        raise ValueError("the target's tokenizer has no chat template")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(tok.chat_template).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt,
        bos_token=tok.bos_token or "", eos_token=tok.eos_token or "")


def _split_at_mark(tok, history: Sequence[dict]) -> tuple[str, str]:
    text = render(tok, [*history, {"role": "user", "content": MARK}], False)
    if text.count(MARK) != 1:
        raise ValueError("the chat template does not render a user message's text once")
    before, after = text.split(MARK)
    return before, after


def user_turn_prefix(tok, history: Sequence[dict] = ()) -> str:
    """The rendered conversation ``history`` up to where the next user turn's text begins."""
    return _split_at_mark(tok, history)[0]


def special_ids(target_dir: Path) -> set[int]:
    """Ids of the tokenizer's special added tokens (<|im_start|>, <|im_end|>, ...)."""
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(Path(target_dir) / "tokenizer.json"))
    return {i for i, t in raw.get_added_tokens_decoder().items() if t.special}


def turn_end_ids(tok, special: set[int]) -> set[int]:
    """The token that closes a user turn, when the template closes it with a special token."""
    ids = tok.encode(_split_at_mark(tok, ())[1])
    return {ids[0]} if ids and ids[0] in special else set()


def prefix_ids(tok, text: str, fallback: int | None) -> list[int]:
    """``text`` encoded; an empty encoding becomes ``[fallback]`` (BOS), so there is a token to
    start from."""
    ids = tok.encode(text)
    if ids:
        return ids
    if fallback is None:
        raise ValueError("the user-turn prefix is empty and the tokenizer has no BOS token")
    return [fallback]


class TurnSampler:
    """The target's tokenizer and the template facts the rounds need, for any engine. An
    engine implements ``draws`` (a round's randomness, from the round's seed alone) and
    ``sample``; the rounds call nothing else that samples, so their filters run unchanged on
    every engine. ``tokens`` counts the target tokens sampled (stop tokens included)."""

    def __init__(self, cfg, target_dir: Path, eos_ids: Sequence[int]) -> None:
        from edge_client.tokenizer import EdgeTokenizer

        self.cfg = cfg
        self.tok = tok = EdgeTokenizer(target_dir)
        self.special = special_ids(target_dir)
        bos = tok.encode(tok.bos_token) if tok.bos_token else []
        self.bos = bos[0] if len(bos) == 1 else None
        self.stop = set(eos_ids) | turn_end_ids(tok, self.special)
        prefix = cfg.user_prefix if cfg.user_prefix is not None else user_turn_prefix(tok)
        self.user_ids = prefix_ids(tok, prefix, self.bos)
        self.tokens = 0

    def draws(self, seed: int) -> Any:
        """The randomness of one round, handed to each ``sample`` call in it in turn."""
        raise NotImplementedError

    def sample(self, prompts: Sequence[Sequence[int]], max_new: int, temperature: float,
               draws: Any) -> list[tuple[list[int], bool]]:
        """Per prompt: the sampled ids (the stop token left out) and whether a stop token
        ended them (False: ``max_new`` did); nucleus sampling at ``cfg.top_p``."""
        raise NotImplementedError

    def start_ids(self, text: str) -> list[int]:
        """Rendered text to sample after, as token ids (BOS when it encodes to nothing)."""
        return prefix_ids(self.tok, text, self.bos)

    def follow_up_ids(self, history: Sequence[dict]) -> list[int]:
        """Where the next user turn after ``history`` starts."""
        return self.start_ids(user_turn_prefix(self.tok, history))

    def user_turns(self, prompts, draws) -> list[tuple[str, list[int], bool]]:
        outs = self.sample(prompts, self.cfg.max_user_tokens, self.cfg.temperature, draws)
        return [(self.tok.decode(ids).strip(), ids, done) for ids, done in outs]


def _pick(logits, temperature: float, top_p: float, gen):
    import torch

    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Drop a token when the tokens above it already hold top_p; the first always stays.
        drop = (sorted_p.cumsum(-1) - sorted_p) > top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=gen).flatten()


def sample_batch(model, prompts: Sequence[Sequence[int]], *, stop_ids: set[int], max_new: int,
                 temperature: float, top_p: float, pad_id: int, gen
                 ) -> list[tuple[list[int], bool]]:
    """Per prompt: the sampled ids (the stop token left out) and whether a stop token ended
    them (False: ``max_new`` did)."""
    import torch
    from transformers import DynamicCache

    n, width = len(prompts), max(len(p) for p in prompts)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for r, p in enumerate(prompts):
        input_ids[r, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
        mask[r, width - len(p):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out: list[list[int]] = [[] for _ in range(n)]
    finished = [False] * n
    if max_new <= 0:
        return list(zip(out, finished, strict=True))
    alive = torch.arange(n)
    cache = DynamicCache()
    with torch.inference_mode():
        logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                       past_key_values=cache, use_cache=True).logits[:, -1, :].float()
        next_pos = positions[:, -1] + 1
        for step in range(max_new):
            token = _pick(logits, temperature, top_p, gen)
            done = torch.zeros(len(alive), dtype=torch.bool)
            for j, r in enumerate(alive.tolist()):
                tid = int(token[j])
                if tid in stop_ids:
                    finished[r] = done[j] = True
                else:
                    out[r].append(tid)
            keep = (~done).nonzero().flatten()
            if keep.numel() == 0 or step == max_new - 1:
                break
            if keep.numel() < len(alive):
                cache.batch_select_indices(keep)
                mask, token, next_pos, alive = mask[keep], token[keep], next_pos[keep], alive[keep]
            mask = torch.cat([mask, torch.ones((len(alive), 1), dtype=mask.dtype)], dim=1)
            logits = model(input_ids=token[:, None], attention_mask=mask,
                           position_ids=next_pos[:, None], past_key_values=cache,
                           use_cache=True).logits[:, -1, :].float()
            next_pos = next_pos + 1
    return list(zip(out, finished, strict=True))
