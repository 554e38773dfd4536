"""Verifier configuration: parsed once (command line or test), frozen, passed down."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from cloud_verifier.draft_policy import DEFAULT_SESSION_COST, DEFAULT_TOKEN_COST
from cloud_verifier.quotas import Quota
from cloud_verifier.tls import ServerTls
from shared.feature_codec import DEFAULT_CODEC, codec_named
from shared.message_limits import MAX_DRAFT_LEN_CEILING


def key_digest(api_key: str) -> str:
    """API keys are kept and compared only as digests."""
    return hashlib.sha256(api_key.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class VerifierConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    # Largest K accepted per round.
    max_draft_len: int = 16
    # Cap on committed length; None means the target's max_position_embeddings.
    max_context: int | None = None
    max_sessions: int = 64
    # A session idle for this long is closed and its KV cache freed.
    session_ttl_s: float = 300.0
    # Drain (SIGTERM): health says NOT_SERVING for at least drain_s while the port stays
    # open, and running generations get up to grace_s (from the signal) to finish; those
    # still running are then told to reopen elsewhere (DRAINING).
    grace_s: float = 25.0
    drain_s: float = 5.0
    # Entries of one draft position's q (SparseDistribution) accepted; bounds the message
    # size limits (shared.message_limits) together with max_context and max_draft_len.
    max_q_support: int = 256
    # Idle streams: one that sends no open within open_timeout_s, or whose reader leaves a
    # Step unread for stalled_reader_s, is closed (STREAM_IDLE). A Verify-rounds session
    # that sends nothing for session_ttl_s expires (SESSION_EXPIRED).
    open_timeout_s: float = 10.0
    stalled_reader_s: float = 60.0
    # HTTP/2 keepalive: the server pings a quiet client every keepalive_s to notice a dead
    # one, and lets clients ping it as often as every min_client_ping_s (the reference
    # client pings every 10 s); faster pingers get GOAWAY too_many_pings.
    keepalive_s: float = 60.0
    min_client_ping_s: float = 5.0
    # Accepted API keys (cloud_verifier.auth): sha256 digests, each key its own tenant;
    # (digest, tenant) pairs (from the environment); and a file re-read on SIGHUP. All empty
    # means no authentication.
    api_key_digests: frozenset[str] = field(default_factory=frozenset)
    api_keys: tuple[tuple[str, str], ...] = ()
    api_keys_file: Path | None = None
    # TLS on the API port; None is plaintext, which needs a loopback host or ``insecure``.
    tls: ServerTls | None = None
    insecure: bool = False
    # Limits of each tenant (cloud_verifier.quotas).
    quota: Quota = field(default_factory=Quota)
    # A session's most new tokens: what max_new_tokens = 0 means, and the most a client may
    # ask for; None: only max_context limits it.
    max_new_tokens_cap: int | None = 2048
    # Continuous batching: new tokens per forward, and how long to wait for more rounds.
    max_batch_tokens: int = 512
    gather_window_s: float = 0.0
    # Beyond this many queued rounds, new rounds get RESOURCE_EXHAUSTED.
    max_queued_rounds: int = 256
    # Cost of one verified token and of one more session, relative to a forward's fixed cost
    # (see draft_policy; python -m cloud_verifier.bench.verify_cost measures them). With
    # fit_verify_cost they are the prior of an online fit to the server's own forwards.
    verify_token_cost: float = DEFAULT_TOKEN_COST
    verify_session_cost: float = DEFAULT_SESSION_COST
    fit_verify_cost: bool = True
    # Bytes of target KV cache all sessions may hold; None means unbounded.
    kv_budget_bytes: int | None = None
    # How long a round may wait for KV memory held by older sessions before it gets
    # RESOURCE_EXHAUSTED.
    kv_wait_s: float = 10.0
    # Closed sessions' KV caches kept for prompts that start with the same tokens
    # (cloud_verifier.prefix_cache), at most this many bytes; 0 disables prefix caching.
    prefix_cache_bytes: int = 256 * 2**20
    # Prometheus HTTP port; None disables the endpoint. It has no authentication, so it
    # listens on loopback unless told otherwise.
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    # Target features for sessions that ask (OpenSession.want_feature), in this wire codec
    # (shared.feature_codec); off: GetInfo advertises none and such opens are refused.
    serve_features: bool = True
    feature_codec: str = DEFAULT_CODEC

    def __post_init__(self) -> None:
        if not 0 <= self.max_draft_len <= MAX_DRAFT_LEN_CEILING:
            raise ValueError(f"max_draft_len must be in [0, {MAX_DRAFT_LEN_CEILING}], got "
                             f"{self.max_draft_len}")
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {self.max_sessions}")
        if self.kv_wait_s < 0:
            raise ValueError(f"kv_wait_s must be >= 0, got {self.kv_wait_s}")
        if self.prefix_cache_bytes < 0:
            raise ValueError(f"prefix_cache_bytes must be >= 0, got {self.prefix_cache_bytes}")
        if self.session_ttl_s <= 0:
            raise ValueError(f"session_ttl_s must be > 0, got {self.session_ttl_s}")
        if self.max_new_tokens_cap is not None and self.max_new_tokens_cap < 1:
            raise ValueError(f"max_new_tokens_cap must be >= 1, got {self.max_new_tokens_cap}")
        if self.max_context is not None and self.max_context < 2:
            raise ValueError(f"max_context must be >= 2, got {self.max_context}")
        if self.max_q_support < 1:
            raise ValueError(f"max_q_support must be >= 1, got {self.max_q_support}")
        codec_named(self.feature_codec)  # ValueError for an unknown name
        for name in ("grace_s", "drain_s", "open_timeout_s", "stalled_reader_s",
                     "keepalive_s", "min_client_ping_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
