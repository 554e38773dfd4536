"""What the vLLM engine asks vLLM for per position (VllmEngine.logprobs_wanted), without vLLM:
a top_k of the vocabulary or more truncates nothing, so it asks for the whole row (-1), never
more logprobs than the vocabulary has, which vLLM refuses (the fuzz suite found an INTERNAL)."""

import pytest

from cloud_verifier.sampling import SamplingParams
from cloud_verifier.sessions import SessionStore
from cloud_verifier.vllm_engine import VllmEngine

VOCAB = 49152


def wanted(sampling: SamplingParams) -> int:
    engine = VllmEngine.__new__(VllmEngine)  # its vLLM is not needed for the choice
    engine.vocab_size = VOCAB
    session = SessionStore(max_sessions=1, ttl_s=60).create("tenant", sampling, [1, 2], 4,
                                                            frozenset())
    return engine.logprobs_wanted(session)


@pytest.mark.parametrize("sampling,want", [
    (SamplingParams(), 1),
    (SamplingParams(temperature=0.8, top_k=20), 20),
    (SamplingParams(temperature=0.8, top_k=VOCAB - 1), VOCAB - 1),
    (SamplingParams(temperature=0.8, top_k=VOCAB), -1),
    (SamplingParams(temperature=0.8, top_k=2**32 - 1), -1),
    (SamplingParams(temperature=0.8), -1),
], ids=["greedy", "top-k", "top-k-below-vocab", "top-k-vocab", "top-k-huge", "full"])
def test_logprobs_asked_of_vllm(sampling, want):
    assert wanted(sampling) == want
