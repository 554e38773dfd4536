"""The draft model q on the edge: an ONNX causal LM with an explicit KV cache.

This module knows nothing about text: it maps token ids to logits. It imports only numpy,
onnxruntime and the standard library, because the device has no torch.

The graph is the one ``edge_client.tools.export_draft.export_onnx`` writes (optimum's
``text-generation-with-past``): inputs ``input_ids`` [1, n], ``attention_mask`` [1, L+n],
``position_ids`` [1, n] and ``past_key_values.{i}.key/.value`` [1, kv_heads, L, head_dim];
outputs ``logits`` [1, n, V] and ``present.{i}.key/.value`` [1, kv_heads, L+n, head_dim].
The graph concatenates past and new keys itself, so the cache is simply its last ``present``.
Rolling back after rejected draft tokens is an explicit ``DraftKVCache.crop``.

A draft may have a reduced vocabulary (``vocab_map.npz`` beside ``model.onnx``: ``sub_to_full``
[N] gives each graph id's full id, -1 for an <unk> input slot, and ``full_vocab_size`` V). Its
head is then much cheaper, at no cost to correctness: q is simply 0 outside the subset.
``forward`` still takes full-vocabulary ids (others are fed as <unk>) and returns full-width
logits, -inf outside the subset, so nothing above this module knows. ``forward_compact``
returns only the subset's columns, with their full ids in ascending order: the drafter
chooses its token and q there, without touching the columns that can never be drawn.

An onnxruntime IOBinding could skip one copy of the cache per step; plain ``run`` is used
because the copies are small next to the matmuls for the model sizes used here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

VOCAB_MAP_FILE = "vocab_map.npz"

_PAST_RE = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")

_ORT_TO_NUMPY = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(bool)": np.bool_,
}


class DraftKVCache:
    """Keys and values of every token the draft has consumed, batch 1.

    ``keys[i]`` and ``values[i]`` are layer i's arrays, shape [1, kv_heads, length, head_dim].
    ``OnnxDraftModel.forward`` replaces them with longer ones; ``crop`` shortens them.
    """

    def __init__(self, keys: list[np.ndarray], values: list[np.ndarray]):
        if len(keys) != len(values) or not keys:
            raise ValueError("need one key and one value array per layer")
        seq = {a.shape[2] for a in (*keys, *values)}
        if len(seq) != 1 or any(a.ndim != 4 or a.shape[0] != 1 for a in (*keys, *values)):
            raise ValueError("cache arrays must all be [1, kv_heads, length, head_dim]")
        self.keys = keys
        self.values = values

    @property
    def length(self) -> int:
        """Number of positions cached (the position the next token will take)."""
        return self.keys[0].shape[2]

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    def crop(self, n: int) -> None:
        """Keep the first ``n`` positions: the rollback after draft tokens are rejected."""
        if not 0 <= n <= self.length:
            raise ValueError(f"crop length {n} outside [0, {self.length}]")
        if n == self.length:
            return
        # A slice of the seq axis is strided; onnxruntime wants contiguous input anyway.
        self.keys = [np.ascontiguousarray(k[:, :, :n, :]) for k in self.keys]
        self.values = [np.ascontiguousarray(v[:, :, :n, :]) for v in self.values]


class OnnxDraftModel:
    """Runs a decoder-only ONNX model (optimum export with past) on the CPU."""

    def __init__(self, model_dir: str | Path, intra_op_threads: int | None = None):
        self._model_dir = Path(model_dir)
        onnx_path = self._model_dir / "model.onnx"
        if not onnx_path.is_file():
            raise FileNotFoundError(f"no model.onnx in {self._model_dir}")
        config_path = self._model_dir / "config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if intra_op_threads is not None:
            options.intra_op_num_threads = intra_op_threads
        self._session = ort.InferenceSession(
            str(onnx_path), sess_options=options, providers=["CPUExecutionProvider"]
        )

        inputs = {i.name: i for i in self._session.get_inputs()}
        outputs = {o.name: o for o in self._session.get_outputs()}
        if "input_ids" not in inputs or "logits" not in outputs:
            raise ValueError(f"{onnx_path} lacks input_ids or logits; not a causal-LM export")

        layers = sorted({int(m.group(1)) for m in map(_PAST_RE.match, inputs) if m})
        if layers != list(range(len(layers))) or not layers:
            raise ValueError(f"{onnx_path} has no past_key_values.<i> inputs (export with past)")
        self._num_layers = len(layers)
        self._past_names = [
            (f"past_key_values.{i}.key", f"past_key_values.{i}.value") for i in layers
        ]
        self._output_names = ["logits"]
        for i in layers:
            self._output_names += [f"present.{i}.key", f"present.{i}.value"]
        missing = [n for n in self._output_names if n not in outputs]
        if missing:
            raise ValueError(f"{onnx_path} lacks outputs {missing}")

        past = inputs["past_key_values.0.key"]
        self._kv_dtype = _ORT_TO_NUMPY[past.type]
        self._ids_dtype = _ORT_TO_NUMPY[inputs["input_ids"].type]
        self._mask_dtype = (
            _ORT_TO_NUMPY[inputs["attention_mask"].type] if "attention_mask" in inputs else None
        )
        self._pos_dtype = (
            _ORT_TO_NUMPY[inputs["position_ids"].type] if "position_ids" in inputs else None
        )
        self._has_cache_branch = "use_cache_branch" in inputs  # older merged decoders
        num_heads = config.get("num_attention_heads")
        self._kv_heads = _static_dim(past.shape, 1) or int(
            config.get("num_key_value_heads", num_heads)
        )
        self._head_dim = _static_dim(past.shape, 3) or int(
            config.get("head_dim") or config["hidden_size"] // num_heads
        )
        logits_shape = outputs["logits"].shape
        self._vocab_size = _static_dim(logits_shape, 2) or int(config["vocab_size"])
        # Some exports keep only the last position's logits; then we feed one token per run.
        self._last_only = _static_dim(logits_shape, 1) == 1
        max_pos = config.get("max_position_embeddings")
        self._max_context = int(max_pos) if max_pos is not None else None
        self._vocab_map: _VocabMap | None = None
        self._all_ids: np.ndarray | None = None  # forward_compact's ids without a vocab map
        if (self._model_dir / VOCAB_MAP_FILE).is_file():
            self._vocab_map = _VocabMap.load(self._model_dir / VOCAB_MAP_FILE, self._vocab_size)
            self._vocab_size = self._vocab_map.full_vocab_size

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def num_layers(self) -> int:
        return self._num_layers

    @property
    def model_dir(self) -> Path:
        return self._model_dir

    @property
    def max_context(self) -> int | None:
        """max_position_embeddings from config.json, when present."""
        return self._max_context

    def new_cache(self) -> DraftKVCache:
        shape = (1, self._kv_heads, 0, self._head_dim)
        return DraftKVCache(
            [np.zeros(shape, self._kv_dtype) for _ in range(self._num_layers)],
            [np.zeros(shape, self._kv_dtype) for _ in range(self._num_layers)],
        )

    def forward(self, cache: DraftKVCache, token_ids: Sequence[int]) -> np.ndarray:
        """Feed ``token_ids`` after the cached positions; extend ``cache`` in place.

        Returns float32 logits [n, V]: row j is the next-token distribution after token j.
        """
        logits = self._logits(cache, np.asarray(token_ids, dtype=np.int64))
        if self._vocab_map is not None:
            return self._vocab_map.to_full_logits(logits)  # [n, V]
        return logits

    def forward_compact(self, cache: DraftKVCache,
                        token_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """``forward`` over the draft's own vocabulary: (logits float32 [n, M], the full ids
        of its M real tokens, ascending). Every full id outside them has logit -inf in
        ``forward``, so argmax, softmax and truncation over these columns, with ties to the
        lowest column, give what they give over ``forward``'s row (ties to the lowest id),
        without touching the V - M columns that can never be drawn (a third of the work for
        a 16k-of-49k draft vocabulary)."""
        logits = self._logits(cache, np.asarray(token_ids, dtype=np.int64))
        if self._vocab_map is not None:
            return self._vocab_map.to_compact_logits(logits), self._vocab_map.compact_ids
        if self._all_ids is None or self._all_ids.size != logits.shape[1]:
            self._all_ids = np.arange(logits.shape[1], dtype=np.int64)
        return logits, self._all_ids

    def _logits(self, cache: DraftKVCache, ids: np.ndarray) -> np.ndarray:
        """The graph's float32 logits [n, graph vocab] after ``ids``, checked."""
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"token_ids must be a non-empty 1-D sequence, got shape {ids.shape}")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self._vocab_size:
            raise ValueError(f"token id out of range [0, {self._vocab_size}): min {lo}, max {hi}")
        if cache.num_layers != self._num_layers:
            raise ValueError(f"cache has {cache.num_layers} layers, model has {self._num_layers}")
        if self._last_only and ids.size > 1:
            return np.concatenate([self._run(cache, ids[j : j + 1]) for j in range(ids.size)])
        return self._run(cache, ids)

    def _run(self, cache: DraftKVCache, ids: np.ndarray) -> np.ndarray:
        past_len, n = cache.length, ids.size
        feed: dict[str, np.ndarray] = {"input_ids": ids.astype(self._ids_dtype, copy=False)[None]}
        if self._mask_dtype is not None:
            feed["attention_mask"] = np.ones((1, past_len + n), dtype=self._mask_dtype)
        if self._pos_dtype is not None:
            feed["position_ids"] = np.arange(past_len, past_len + n, dtype=self._pos_dtype)[None]
        if self._has_cache_branch:
            feed["use_cache_branch"] = np.array([past_len > 0])
        for i, (key_name, value_name) in enumerate(self._past_names):
            feed[key_name] = cache.keys[i]
            feed[value_name] = cache.values[i]

        if self._vocab_map is not None:
            feed["input_ids"] = self._vocab_map.to_sub(ids).astype(self._ids_dtype)[None]

        logits, *present = self._session.run(self._output_names, feed)
        if logits.shape[1] != n:
            raise RuntimeError(f"graph returned logits for {logits.shape[1]} positions, fed {n}")
        cache.keys = present[0::2]
        cache.values = present[1::2]
        return logits[0].astype(np.float32, copy=False)  # [n, graph vocab]


class _VocabMap:
    """Between full-vocabulary ids and the ids of a reduced-vocabulary graph."""

    def __init__(self, sub_to_full: np.ndarray, full_vocab_size: int, graph_vocab: int):
        sub_to_full = np.asarray(sub_to_full, dtype=np.int64)  # [N]
        if sub_to_full.shape != (graph_vocab,):
            raise ValueError(f"vocab map has {sub_to_full.size} ids, the graph {graph_vocab}")
        real = sub_to_full >= 0
        kept = sub_to_full[real]
        if kept.size and (kept.max() >= full_vocab_size or np.unique(kept).size != kept.size):
            raise ValueError("vocab map ids must be distinct and inside the full vocabulary")
        unk = np.flatnonzero(~real)
        self.full_vocab_size = int(full_vocab_size)
        self._sub_ids = np.flatnonzero(real)  # [M] graph ids with a real token
        self._full_ids = kept  # [M] their full ids
        # Ids outside the subset are fed as <unk>; without an <unk> slot they are refused.
        self._full_to_sub = np.full(full_vocab_size, unk[0] if unk.size else -1, np.int64)
        self._full_to_sub[kept] = self._sub_ids
        # The real columns in ascending full-id order (forward_compact).
        by_id = np.argsort(kept, kind="stable")
        self._compact_cols, self.compact_ids = self._sub_ids[by_id], kept[by_id]

    @classmethod
    def load(cls, path: Path, graph_vocab: int) -> _VocabMap:
        with np.load(path) as z:
            return cls(z["sub_to_full"], int(z["full_vocab_size"]), graph_vocab)

    def to_sub(self, ids: np.ndarray) -> np.ndarray:
        sub = self._full_to_sub[ids]
        if (sub < 0).any():
            raise ValueError("token id outside the draft's vocabulary and no <unk> slot")
        return sub

    def to_compact_logits(self, logits: np.ndarray) -> np.ndarray:
        return logits[:, self._compact_cols]  # [n, M], columns of compact_ids

    def to_full_logits(self, logits: np.ndarray) -> np.ndarray:
        out = np.full((logits.shape[0], self.full_vocab_size), -np.inf, dtype=np.float32)
        out[:, self._full_ids] = logits[:, self._sub_ids]
        return out  # [n, V]


def _static_dim(shape: Sequence[object], axis: int) -> int | None:
    if len(shape) > axis and isinstance(shape[axis], int) and shape[axis] > 0:
        return shape[axis]
    return None
