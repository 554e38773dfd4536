"""What opening and editing a session asks for, once checked: cloud_verifier.wire parses the
protobuf into these, and the round runner (cloud_verifier.rounds) serves them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cloud_verifier.sampling import SamplingParams
    from cloud_verifier.target_engine import DraftRound


@dataclass(frozen=True)
class OpenParams:
    prompt: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    drafting: int  # ROUNDS or LOOKAHEAD (a Generate's params say ROUNDS and have no draft)
    # Rounds: round 0 (NO_DRAFT when unset: one plain step). Lookahead: the first lookahead,
    # None when unset.
    first_draft: DraftRound | None
    editable: bool = False  # serves many suggestions (rounds only)
    want_feature: bool = False  # each Step carries the target feature (Step.feature)
    continue_with: bytes = b""  # token healing: the new tokens must begin with these bytes


@dataclass(frozen=True)
class EditParams:
    """An edit of an editable session's text, starting suggestion ``suggestion``."""

    keep: int
    append: list[int]
    suggestion: int
    max_new_tokens: int
    continue_with: bytes = b""
