"""Greedy edge+cloud output is the real target's own greedy output, token for token.

20 chat prompts x 48 new tokens with SmolLM2-135M-Instruct as the target and the shipped
distilled ONNX draft on the client, through real gRPC. The reference is transformers' greedy
``generate``. Verification scores K+1 positions in one forward while ``generate`` scores one
at a time, so logits differ in the last bits (measured: at most 7.6e-5 on this CPU). A
divergence is accepted only where the reference's two best logits are within NEAR_TIE of
each other and the client's token is one of them; everything else fails.
"""

from __future__ import annotations

import pytest
import torch

from cloud_verifier.config import VerifierConfig
from cloud_verifier.server import EmbeddedVerifier
from cloud_verifier.target_model import load_target
from edge_client.client import EdgeClient, GenerationConfig
from shared.paths import default_draft_dir
from shared.prompts import CHAT_PROMPTS

NEW_TOKENS = 48
NUM_PROMPTS = 20
NEAR_TIE = 1e-3  # logit units; >10x the measured batch-shape noise

pytestmark = pytest.mark.real_model


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def test_greedy_edge_cloud_matches_target_generate(real_assets):
    target_dir, _ = real_assets
    draft_dir = default_draft_dir()  # the shipped distilled draft: multi-token rounds
    target = load_target(target_dir, device="cpu", dtype="float32")
    explained = []
    with EmbeddedVerifier(target, VerifierConfig(port=0)) as verifier, \
            EdgeClient(verifier.address, draft_dir) as client:
        for prompt in CHAT_PROMPTS[:NUM_PROMPTS]:
            ids = client.tokenizer.encode_chat(prompt)
            gen = client.generate(ids, GenerationConfig(max_new_tokens=NEW_TOKENS,
                                                        draft_len=3))
            list(gen)
            with torch.inference_mode():
                ref = target.model.generate(
                    torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                    max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                    return_dict_in_generate=True, pad_token_id=target.eos_token_ids[0])
            want = ref.sequences[0, len(ids):].tolist()
            i = first_divergence(gen.token_ids, want)
            if i is None:
                continue
            assert i < len(want) and i < len(gen.token_ids), (
                f"{prompt!r}: one output is a strict prefix of the other at {i}")
            logits = ref.logits[i][0]
            top2 = torch.topk(logits, 2)
            gap = float(top2.values[0] - top2.values[1])
            assert gap <= NEAR_TIE and gen.token_ids[i] in top2.indices.tolist(), (
                f"{prompt!r}: token {i} is {gen.token_ids[i]}, target says {want[i]} "
                f"with a top-2 logit gap of {gap:.2e} (not a near tie)")
            explained.append((prompt, i, gap))
    # Ties are rare; if most prompts needed one, something else is wrong.
    assert len(explained) <= NUM_PROMPTS // 4, explained
