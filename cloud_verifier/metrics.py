"""Prometheus metrics of one verifier. Names follow Prometheus conventions and, where vLLM
exposes the same quantity (spec_decode_num_*_tokens_total), the same spirit."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0,
                    2.5, 5.0)


class VerifierMetrics:
    """Owns its registry, so that several verifiers (tests) can live in one process."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.rounds = Counter("edgespec_verify_rounds", "Verification rounds applied.",
                              registry=r)
        self.draft_tokens = Counter("edgespec_spec_decode_num_draft_tokens",
                                    "Draft tokens received for verification.", registry=r)
        self.accepted_tokens = Counter("edgespec_spec_decode_num_accepted_tokens",
                                       "Draft tokens accepted.", registry=r)
        self.emitted_tokens = Counter("edgespec_spec_decode_num_emitted_tokens",
                                      "Tokens committed (accepted plus correction/bonus).",
                                      registry=r)
        self.target_forwards = Counter("edgespec_target_forwards",
                                       "Target model forward passes.", registry=r)
        self.rejected_requests = Counter("edgespec_rejected_requests",
                                         "Requests answered with an error, by status code.",
                                         ["code"], registry=r)
        self.active_sessions = Gauge("edgespec_active_sessions", "Open sessions.", registry=r)
        self.queue_seconds = Histogram("edgespec_verify_queue_seconds",
                                       "Time a round waited for the model.",
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self.forward_seconds = Histogram("edgespec_verify_forward_seconds",
                                         "Target forward time of a round.",
                                         buckets=_LATENCY_BUCKETS, registry=r)

        self.batch_sessions = Histogram("edgespec_batch_sessions",
                                        "Sessions verified in one forward.",
                                        buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.batch_tokens = Histogram("edgespec_batch_tokens", "New tokens in one forward.",
                                      buckets=(1, 8, 16, 32, 64, 128, 256, 512, 1024),
                                      registry=r)
        self.drafted_by_position = Counter(
            "edgespec_spec_decode_num_drafts_by_position",
            "Drafts verified at each draft position (1-based).", ["position"], registry=r)
        self.accepted_by_position = Counter(
            "edgespec_spec_decode_num_accepted_tokens_by_position",
            "Drafts accepted at each draft position (1-based); divide by the drafted count "
            "for acceptance by position.", ["position"], registry=r)
        self.tokens_per_round = Histogram("edgespec_tokens_per_round",
                                          "Tokens committed per verification round.",
                                          buckets=(1, 2, 3, 4, 5, 6, 8, 12, 17), registry=r)
        self.lookahead_forwards = Counter(
            "edgespec_lookahead_forwards",
            "Forwards of lookahead-mode sessions, by what the latest lookahead gave: fresh (drafts "
            "verified), stale (it no longer continued the text, or was used up), none (none "
            "received yet, or drafting did not pay), unsure (fresh, but its confidences made "
            "no draft worth verifying).", ["lookahead"], registry=r)
        self.evictions = Counter("edgespec_session_evictions",
                                 "Sessions evicted, by reason.", ["reason"], registry=r)
        self.preemptions = Counter(
            "edgespec_num_preemptions",
            "Sessions whose KV cache was dropped for an older session's round under the KV "
            "budget (recomputed when they next run).", registry=r)
        self.kv_bytes = Gauge("edgespec_kv_cache_bytes", "Target KV cache bytes allocated.",
                              registry=r)
        # As vLLM's prefix_cache_queries / prefix_cache_hits: counted in tokens.
        self.prefix_cache_queries = Counter(
            "edgespec_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (all but the last of each prompt).",
            registry=r)
        self.prefix_cache_hits = Counter(
            "edgespec_prefix_cache_hits",
            "Prompt tokens whose keys and values came from the prefix cache.", registry=r)
        self.prefix_cache_bytes = Gauge(
            "edgespec_prefix_cache_bytes",
            "KV cache bytes held by closed sessions for prefix reuse (part of "
            "edgespec_kv_cache_bytes; freed first under memory pressure).", registry=r)

        # The online fit of a forward's cost that the suggested draft length is chosen by
        # (draft_policy.VerifyCostModel): fixed seconds, and session/token costs relative to it.
        self.verify_fixed_seconds = Gauge(
            "edgespec_verify_cost_fixed_seconds",
            "Fitted fixed cost of one target forward.", registry=r)
        self.verify_session_cost = Gauge(
            "edgespec_verify_cost_per_session_ratio",
            "Fitted cost of one more session in a forward, relative to the fixed cost.",
            registry=r)
        self.verify_token_cost = Gauge(
            "edgespec_verify_cost_per_token_ratio",
            "Fitted cost of one more token in a forward, relative to the fixed cost.",
            registry=r)

        # Editing sessions (OpenSession.editable) and cancelled work.
        self.edits = Counter("edgespec_session_edits",
                             "Edits applied to editable sessions (each starts a suggestion).",
                             registry=r)
        self.edit_kept_tokens = Counter(
            "edgespec_session_edit_kept_tokens",
            "Committed tokens edits kept (their KV cache was reused, not recomputed).",
            registry=r)
        self.cancelled_rounds = Counter(
            "edgespec_cancelled_rounds",
            "Rounds dropped before their forward because the client cancelled or superseded "
            "them (an edit, a half-close).", registry=r)
        # Acceptance collapse: the suggested draft length fell to 0 (the client stops
        # drafting and decodes; the server probes with K = 1 now and then) or came back.
        self.speculation_changes = Counter(
            "edgespec_speculation_changes",
            "Sessions whose suggested draft length fell to 0 (collapsed) or rose from 0 "
            "(resumed).", ["change"], registry=r)
        self.sessions_not_speculating = Gauge(
            "edgespec_sessions_not_speculating",
            "Open sessions whose drafts do not pay now (suggested draft length 0).",
            registry=r)

    def serve_http(self, port: int, addr: str = "127.0.0.1") -> None:
        start_http_server(port, addr=addr, registry=self.registry)
