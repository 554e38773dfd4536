"""What an editing session (edge_client.document) needs of the client that opens it.

``AsyncEdgeClient`` and ``EdgeClient`` (edge_client.client) satisfy these protocols; the
document is written against them, so it does not import the client that imports it.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from edge_client.connection import Connection
    from edge_client.draft_model import OnnxDraftModel
    from edge_client.feature_draft import FeatureHead
    from edge_client.generation_state import ServerLimits
    from edge_client.rate_chooser import RateChooser
    from edge_client.tokenizer import EdgeTokenizer
    from shared.pb import verifier_pb2 as pb

T = TypeVar("T")


class DocumentClient(Protocol):
    """The asynchronous client (``AsyncEdgeClient``) as an ``AsyncDocument`` uses it."""

    info: pb.GetInfoResponse | None  # None: no verifier has answered (draft-only start)
    fallback: str
    protocol: str
    model: OnnxDraftModel
    tokenizer: EdgeTokenizer
    conn: Connection
    chooser: RateChooser

    def feature_head(self) -> FeatureHead: ...

    def limits(self, draft_len: int) -> ServerLimits: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    async def reach_verifier(self, required: bool = False) -> bool: ...


class SyncDocumentClient(Protocol):
    """The synchronous client (``EdgeClient``) as a ``Document`` uses it: it runs a
    coroutine on its event-loop thread and returns the result."""

    def _call(self, coro: Awaitable[T]) -> T: ...
