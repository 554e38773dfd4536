"""The draft's reduced vocabulary: the ``--sub-vocab`` target tokens with the most mass in the
data, plus one <unk> input slot (lossless: q is simply 0 outside them). ``vocab_map.npz``
beside the ONNX model lets ``OnnxDraftModel`` keep taking and returning full-vocabulary ids."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_client.tools.distill.shards import Sample

VOCAB_MAP_FILE = "vocab_map.npz"


@dataclass(frozen=True)
class VocabMap:
    """sub_to_full[i] is the full id of draft id i; -1 marks the <unk> input slot."""

    sub_to_full: np.ndarray  # [N] int64
    full_vocab_size: int

    @property
    def size(self) -> int:
        return len(self.sub_to_full)

    @property
    def unk(self) -> int:
        """The <unk> input slot, -1 when every full id is kept."""
        slots = np.flatnonzero(self.sub_to_full < 0)
        return int(slots[0]) if slots.size else -1

    def full_to_sub(self) -> np.ndarray:
        """[V] int64: draft id of each full id, the <unk> slot for ids outside the subset."""
        table = np.full(self.full_vocab_size, self.unk, dtype=np.int64)
        real = self.sub_to_full >= 0
        table[self.sub_to_full[real]] = np.flatnonzero(real)
        return table

    def save(self, path: Path) -> None:
        np.savez(path, sub_to_full=self.sub_to_full.astype(np.int64),
                 full_vocab_size=np.int64(self.full_vocab_size))

    @classmethod
    def load(cls, path: Path) -> VocabMap:
        with np.load(path) as z:
            return cls(z["sub_to_full"].astype(np.int64), int(z["full_vocab_size"]))

    @classmethod
    def identity(cls, vocab: int) -> VocabMap:
        # No <unk> slot needed: every id is kept. unk is then never used.
        return cls(np.arange(vocab, dtype=np.int64), vocab)


def build_vocab_map(samples: Sequence[Sample], full_vocab: int, size: int,
                    always: Sequence[int] = ()) -> VocabMap:
    """Keep the ``size - 1`` tokens with the most target probability mass, plus <unk>.

    Mass counts every token the draft reads (prompt and continuation) and the target's top-k
    probabilities at every generated position, so tokens the target likes but rarely samples
    are kept too.
    """
    counts = np.zeros(full_vocab, dtype=np.float64)
    for s in samples:
        np.add.at(counts, s.prompt_ids.astype(np.int64), 1.0)
        np.add.at(counts, s.gen_ids.astype(np.int64), 1.0)
        p = np.exp(s.topk_logp.astype(np.float32))
        np.add.at(counts, s.topk_ids.reshape(-1), p.reshape(-1))
    counts[list(always)] = np.inf
    keep_n = min(size - 1, int((counts > 0).sum()))
    keep = np.sort(np.argsort(-counts, kind="stable")[:keep_n])
    return VocabMap(np.concatenate([keep, [-1]]).astype(np.int64), full_vocab)
