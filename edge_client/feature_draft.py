"""A draft conditioned on the target's hidden state, on the device (numpy + onnxruntime).

The verifier can send, with a verify result, the target's final hidden state f (after its
final norm) at the position that decided a committed token x_m, in the wire form its GetInfo
names (``shared.feature_codec``). ``FeatureHead.propose`` drafts from it: a chain whose first steps
read the committed tokens x_m .. x_n (just x_n when the feature is fresh; more when it arrived
a round late, in lookahead drafting) and whose last step after x_n gives d_1; each draft is
fed back to give the next. Every step is one run of the exported head (``edgespec-distill
export-head``, trained by ``train-head``; the design is in ``docs/feature-draft.md``):

    inputs  input_ids [B, n] int64 (draft ids), features [B, n, H] float32,
            past_key, past_value [B, kv_heads, P, head_dim] float32 (this chain's cache)
    outputs logits [B, n, M], next_features [B, n, H], present_key, present_value

``vocab_map.npz`` maps ids as for ``OnnxDraftModel``: draft id i is full id sub_to_full[i]
(-1: the <unk> input slot for tokens outside the sub-vocabulary); output index j is the j-th
real draft id. ``feature_head.json`` says which target the head reads: ``FeatureSpec``, which
the caller fills from the verifier's GetInfo; a head trained for other weights refuses to load
(``IncompatibleVerifier``): their hidden states would mean something else.

q is exact, as for ``ModelDrafter``: each draft is sampled from ``truncated_distribution`` of
the full-vocabulary logits (-inf outside the sub-vocabulary), and that (ids, probs) is what the
Proposal carries, so verification stays lossless.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from edge_client.drafter import DraftSampling, Proposal, top_probability
from edge_client.errors import IncompatibleVerifier
from edge_client.sampling import sample, truncated_distribution
from shared.feature_codec import EncodedFeature, codec_named

METADATA_FILE = "feature_head.json"
VOCAB_MAP_FILE = "vocab_map.npz"
KIND = "feature-head"


@dataclass(frozen=True)
class FeatureSpec:
    """The feature a verifier serves (GetInfo), or the one a head was trained on."""

    layer: str  # "final_norm": after the target's final norm, what its LM head reads
    hidden_size: int
    dtype: str  # the wire codec's name (shared.feature_codec): "fp16", "int8-g32", ...
    target_fingerprint: str  # shared.fingerprint.weights_fingerprint of the target

    def mismatch(self, other: FeatureSpec) -> list[str]:
        return [f"{name} {getattr(self, name)!r} (verifier: {getattr(other, name)!r})"
                for name in ("target_fingerprint", "layer", "hidden_size", "dtype")
                if getattr(self, name) != getattr(other, name)]


def read_spec(model_dir: str | Path) -> FeatureSpec:
    """The FeatureSpec a head directory was trained for."""
    meta = _metadata(Path(model_dir))
    return FeatureSpec(meta["feature_layer"], int(meta["hidden_size"]), meta["feature_dtype"],
                       meta["target_fingerprint"])


def _metadata(model_dir: Path) -> dict:
    path = model_dir / METADATA_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {METADATA_FILE} in {model_dir}: not a feature head")
    meta = json.loads(path.read_text())
    if meta.get("kind") != KIND:
        raise ValueError(f"{path}: kind {meta.get('kind')!r}, expected {KIND!r}")
    return meta


class FeatureHead:
    """An exported feature head, checked against the verifier's ``FeatureSpec``."""

    def __init__(self, model_dir: str | Path, verifier: FeatureSpec,
                 intra_op_threads: int | None = None) -> None:
        self._model_dir = Path(model_dir)
        meta = _metadata(self._model_dir)
        self.spec = read_spec(self._model_dir)
        self.codec = codec_named(self.spec.dtype)
        wrong = self.spec.mismatch(verifier)
        if wrong:
            raise IncompatibleVerifier(
                f"feature head {self._model_dir} was trained for another target feature: "
                f"{'; '.join(wrong)}. Its drafts would read hidden states that mean something "
                "else; use an independent draft, or a head trained against this verifier's "
                "target (edgespec-distill train-head)")
        self.max_chain = int(meta["max_chain"])
        self._kv_heads, self._head_dim = int(meta["kv_heads"]), int(meta["head_dim"])
        with np.load(self._model_dir / VOCAB_MAP_FILE) as z:
            sub_to_full = z["sub_to_full"].astype(np.int64)  # [N]
            self.vocab_size = int(z["full_vocab_size"])
        real = sub_to_full >= 0
        unk = np.flatnonzero(~real)
        self._full_to_sub = np.full(self.vocab_size, unk[0] if unk.size else -1, np.int64)
        self._full_to_sub[sub_to_full[real]] = np.flatnonzero(real)
        self._out_full = sub_to_full[real]  # [M] full id of each output index

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if intra_op_threads is not None:
            options.intra_op_num_threads = intra_op_threads
        self._session = ort.InferenceSession(str(self._model_dir / "model.onnx"),
                                             sess_options=options,
                                             providers=["CPUExecutionProvider"])
        self.steps_run = 0  # graph runs, for step-time accounting

    def propose(self, feature: EncodedFeature, tail: Sequence[int], k: int,
                sampling: DraftSampling, rng: np.random.Generator) -> Proposal:
        """Drafts k tokens after ``tail[-1]``.

        feature: the encoded feature [H] that decided ``tail[0]`` (ValueError if its sizes
        are not this head's codec's).
        tail: the committed tokens from that one to the last (at least one, full ids).
        Greedy drafts carry no q (point masses) and their confidence; sampled ones carry the
        exact (ids, probs) each was drawn from, using one ``rng.random()`` per draft.
        """
        g = self.codec.decode(feature.values, feature.scales,
                              self.spec.hidden_size)[None, None, :]  # [1, 1, H]
        tail = [int(t) for t in tail]
        if not tail:
            raise ValueError("tail needs at least the token the feature decided")
        if min(tail) < 0 or max(tail) >= self.vocab_size:
            raise ValueError(f"tail token id outside [0, {self.vocab_size})")
        if k < 0 or len(tail) + max(k, 1) - 1 > self.max_chain:
            raise ValueError(f"a chain of {len(tail)} known tokens and k={k} drafts exceeds "
                             f"the head's {self.max_chain} positions")
        if k == 0:
            return Proposal([], None)
        past = np.zeros((1, self._kv_heads, 0, self._head_dim), np.float32)
        cache = (past, past)
        for token in tail:
            logits, g, cache = self._step(token, g, cache)
        tokens: list[int] = []
        q: list[tuple[np.ndarray, np.ndarray]] = []
        confidence: list[float] = []
        for i in range(k):
            if sampling.is_greedy:
                token = int(np.argmax(logits))
                confidence.append(top_probability(logits))
            else:
                ids, probs = truncated_distribution(logits, sampling.temperature, sampling.top_k,
                                                    sampling.top_p, sampling.max_support)
                token = sample(ids, probs, rng)
                q.append((ids, probs))
            tokens.append(token)
            if i < k - 1:
                logits, g, cache = self._step(token, g, cache)
        return Proposal(tokens, None, confidence) if sampling.is_greedy else Proposal(tokens, q)

    def _step(self, token: int, g: np.ndarray, cache):
        """One chain step -> (full-vocabulary logits [V], next features [1, 1, H], cache)."""
        sub = self._full_to_sub[token]
        if sub < 0:
            raise ValueError(f"token {token} is outside the head's vocabulary (no <unk> slot)")
        logits, nxt, key, value = self._session.run(
            ["logits", "next_features", "present_key", "present_value"],
            {"input_ids": np.array([[sub]], np.int64), "features": g,
             "past_key": cache[0], "past_value": cache[1]})
        self.steps_run += 1
        full = np.full(self.vocab_size, -np.inf, dtype=np.float32)
        full[self._out_full] = logits[0, 0]
        return full, nxt, (key, value)
