"""The typing run's figures, from its keystroke records; the JSON report.

Per mode (``modes.<name>.aggregate``), over the keys of the measured phase:

- ``suggest_ms_p50/p95``: key press to the whole suggestion shown (its 4-12 tokens, or fewer
  when the target ends the text), over the keys whose suggestion was whole before the next
  key; ``first_token_ms_p50/p95``: key press to the first suggested token shown, over the keys
  that got one (previews not counted). Both are conditional on the suggestion arriving, so
  ``full_fraction`` says how many did, and ``suggest_ms_p95_all_keys`` counts a key that got
  no whole suggestion as infinitely late (null when more than 5 % of the keys got none).
- ``previewed_keys``, ``preview_ms_p50/p95``: keys whose suggestion first showed the
  draft's own continuation while it waited for the typing (edit sessions,
  ``GenerationConfig.preview``), and key press to that preview.
- ``forwards_per_keystroke`` and ``tokens_computed_per_keystroke``: the verifier's target
  forwards and the tokens they computed, per key, from its counters (``forwards_source``
  "server"); without a metrics endpoint, the forwards the client saw ("client"), cancelled
  suggestions' work past their cancel not included.
- ``cancelled``: suggestions a newer key (or the end of the field) cancelled before they
  were whole, with the forwards they had cost and the tokens they had shown.
- ``breakdown_ms``: means per whole suggestion of the client's drafting time, the network
  (waiting for replies minus the verifier's own time), the verifier's queue + forward time,
  and the rest (``other``: the settle wait, stopping the last suggestion, the client's own
  work); ``breakdown_ms_p95_tail``: the same over the whole suggestions at or above the p95.
- ``errors``: failures raised to the IME, by status; ``retried``: attempts the client lost
  and retried on its own, by status.

``modes.<name>.outage`` summarises the drill by phase (``before``, ``down``, ``after``).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np

from edge_client.bench.ime.modes import KeyRecord
from edge_client.bench.ime.typist import KEY_KINDS
from edge_client.bench.ime.verifier import Work

PHASES = ("before", "down", "after")


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 2) if values else None


def _mean(values: list[float]) -> float | None:
    return round(float(np.mean(values)), 3) if values else None


def _censored_pct(records: list[KeyRecord], q: float) -> float | None:
    """The q-th percentile of full-suggestion latency over all keys, a key without a whole
    suggestion counting as infinitely late (nearest rank); None when it lands on one."""
    values = sorted(math.inf if r.full_ms is None else r.full_ms for r in records)
    if not values:
        return None
    value = values[max(0, math.ceil(q / 100 * len(values)) - 1)]
    return None if math.isinf(value) else round(value, 2)


def forwards_by_kind(records: list[KeyRecord]) -> dict:
    """Per key kind: keys, and the target forwards the client saw per key of that kind."""
    out = {}
    for kind in KEY_KINDS:
        rs = [r for r in records if r.kind == kind]
        if rs:
            out[kind] = {"keys": len(rs), "forwards_per_key":
                         round(sum(r.target_forwards for r in rs) / len(rs), 4)}
    return out


def _slowest(full: list[KeyRecord], q: float) -> list[KeyRecord]:
    """The whole suggestions at or above the q-th percentile of their latency."""
    if not full:
        return []
    edge = np.percentile([r.full_ms for r in full], q)
    return [r for r in full if r.full_ms >= edge]


def breakdown(full: list[KeyRecord]) -> dict:
    """Means over whole suggestions of where their time went: the client's drafting, the
    network, the verifier, and the rest of the key-to-suggestion time (``other``: the wait
    for the typing to settle, stopping the suggestion before, the client's own work)."""
    return {
        "draft": _mean([r.draft_ms for r in full]),
        "network": _mean([r.network_ms for r in full]),
        "verify": _mean([r.verify_ms for r in full]),
        "other": _mean([r.full_ms - r.draft_ms - r.network_ms - r.verify_ms for r in full]),
        "suggestions": len(full),
    }


def aggregate(records: list[KeyRecord], work: Work | None) -> dict:
    keys = len(records)
    full = [r for r in records if r.full_ms is not None]
    shown = [r for r in records if r.first_ms is not None]
    previewed = [r for r in records if r.preview_ms is not None]
    cancelled = [r for r in records if r.cancelled]
    errors: Counter = Counter(r.error for r in records if r.error)
    retried: Counter = Counter()
    for r in records:
        retried.update(r.retried)
    client_forwards = sum(r.target_forwards for r in records)
    fed = [r.fed_tokens for r in records if r.fed_tokens is not None]
    drafted, accepted = sum(r.drafted for r in records), sum(r.accepted for r in records)
    per_key = (lambda x: round(x / keys, 4)) if keys else (lambda x: None)
    if work is not None:
        forwards, source, computed = work.forwards, "server", per_key(work.tokens)
    else:
        forwards, source = client_forwards, "client"
        computed = per_key(sum(fed)) if len(fed) == keys and keys else None
    return {
        "keystrokes": keys,
        "suggestions_full": len(full),
        "full_fraction": round(len(full) / keys, 4) if keys else None,
        "suggestions_shown": len(shown),
        "suggest_ms_p50": _pct([r.full_ms for r in full], 50),
        "suggest_ms_p95": _pct([r.full_ms for r in full], 95),
        "first_token_ms_p50": _pct([r.first_ms for r in shown], 50),
        "first_token_ms_p95": _pct([r.first_ms for r in shown], 95),
        "suggest_ms_p95_all_keys": _censored_pct(records, 95),
        # Edit sessions: keys that got the draft's preview while waiting, and how soon.
        "previewed_keys": len(previewed),
        "preview_ms_p50": _pct([r.preview_ms for r in previewed], 50),
        "preview_ms_p95": _pct([r.preview_ms for r in previewed], 95),
        "forwards_per_keystroke": per_key(forwards),
        "forwards_source": source,
        "client_forwards_per_keystroke": per_key(client_forwards),
        # The client's forwards by where each key left the text (typist.key_kind).
        "client_forwards_by_key": forwards_by_kind(records),
        "tokens_computed_per_keystroke": computed,
        "tokens_per_suggestion": _mean([r.tokens + r.unverified for r in full]),
        "unverified_tokens": sum(r.unverified for r in records),
        # Edit sessions: committed tokens each edit kept, and tokens the forwards fed.
        "kept_tokens_per_keystroke": _mean([r.kept_tokens for r in records
                                            if r.kept_tokens is not None]),
        "client_fed_tokens_per_keystroke": per_key(sum(fed)) if fed else None,
        # Edit sessions: keys whose suggestion kept verified tokens of the last one
        # (type-through), and those that needed no RPC at all.
        "typed_through_keys": sum(r.reused_tokens > 0 for r in records),
        "typed_through_no_rpc": sum(r.reused_tokens > 0 and r.target_forwards == 0
                                    and r.full_ms is not None for r in records),
        "acceptance": round(accepted / drafted, 4) if drafted else None,
        "cancelled": {
            "suggestions": len(cancelled),
            "fraction": round(len(cancelled) / keys, 4) if keys else None,
            "target_forwards": sum(r.target_forwards for r in cancelled),
            "tokens_shown": sum(r.tokens + r.unverified for r in cancelled),
        },
        "breakdown_ms": breakdown(full),
        # The same over the slowest whole suggestions (at or above the p95): what the tail is.
        "breakdown_ms_p95_tail": breakdown(_slowest(full, 95)),
        "errors": dict(errors),
        "error_examples": _examples(records),
        "retried": dict(retried),
    }


def _examples(records: list[KeyRecord]) -> dict[str, str]:
    """The first message of each failure status."""
    out: dict[str, str] = {}
    for r in records:
        if r.error and r.error not in out:
            out[r.error] = r.error_message or ""
    return out


def outage_summary(records: list[KeyRecord], drill: dict) -> dict:
    """What the user saw before, during and after the outage."""
    by_phase = {}
    for phase in PHASES:
        rs = [r for r in records if r.phase == phase]
        shown = [r for r in rs if r.first_ms is not None]
        by_phase[phase] = {
            "keystrokes": len(rs),
            "suggestions_shown": len(shown),
            "verified_suggestions": sum(1 for r in shown if r.unverified == 0),
            "unverified_suggestions": sum(1 for r in shown if r.unverified > 0),
            "unverified_tokens": sum(r.unverified for r in rs),
            "suggest_ms_p50": _pct([r.full_ms for r in rs if r.full_ms is not None], 50),
        }
    after = [r for r in records if r.phase == "after" and r.first_ms is not None]
    first = next((i for i, r in enumerate(after) if r.unverified == 0 and r.full_ms is not None),
                 None)
    first_verified = None if first is None else after[first]
    errors: Counter = Counter(r.error for r in records if r.error)
    retried: Counter = Counter()
    for r in records:
        retried.update(r.retried)
    return {
        "killed_after_s": round(drill["killed"] - drill["started"], 3),
        "down_s": round(drill["serving"] - drill["killed"], 3),
        "fields": drill["fields"],
        "phases": by_phase,
        # Suggestions kept coming while the verifier was away.
        "suggestions_continued": by_phase["down"]["suggestions_shown"] > 0,
        # Recovered: from the first whole verified suggestion after the restart on, every
        # suggestion shown was verified (before it, the client was still reconnecting).
        "all_verified_after_recovery": first is not None and all(
            r.unverified == 0 for r in after[first:]),
        "unverified_before_recovery": 0 if first is None else sum(
            1 for r in after[:first] if r.unverified > 0),
        "replaced_tokens_after_restart": sum(r.replaced_tokens for r in records
                                             if r.phase == "after"),
        "first_verified_after_restart_ms": (
            None if first_verified is None
            else round((first_verified.at + first_verified.full_ms / 1000
                        - drill["serving"]) * 1000, 1)),
        "client_errors": sum(errors.values()),
        "errors": dict(errors),
        "error_examples": _examples(records),
        "retried": dict(retried),
        "reopens": sum(r.reopens for r in records),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def comparison(modes: dict[str, dict]) -> dict:
    """Edit sessions against reopening and cloud-only, where both ran."""
    out = {}
    edit = (modes.get("edit") or {}).get("aggregate")
    for other in ("reopen", "cloud-only"):
        agg = (modes.get(other) or {}).get("aggregate")
        if edit is None or agg is None:
            continue
        out[f"edit_vs_{other}"] = {
            key: _ratio(edit[key], agg[key])
            for key in ("forwards_per_keystroke", "tokens_computed_per_keystroke",
                        "suggest_ms_p50", "suggest_ms_p95")}
    return out


def build_report(result, settings: dict, verifier: dict, unavailable: dict[str, str]) -> dict:
    modes: dict[str, dict] = {}
    for name, reason in unavailable.items():
        modes[name] = {"available": False, "reason": reason}
    names = list(dict.fromkeys(r.mode for r in result.records))
    for name in names:
        typing = [r for r in result.records if r.mode == name and r.phase == "typing"]
        drill = [r for r in result.records if r.mode == name and r.phase in PHASES]
        work = result.server_work.get(name) if result.server_work is not None else None
        modes[name] = {
            "available": True,
            "aggregate": aggregate(typing, work),
            "outage": (outage_summary(drill, result.drills[name])
                       if name in result.drills else None),
            "samples": {"suggest_ms": [round(r.full_ms, 1) for r in typing
                                       if r.full_ms is not None],
                        "first_token_ms": [round(r.first_ms, 1) for r in typing
                                           if r.first_ms is not None]},
        }
    return {"benchmark": "ime", "settings": settings, "verifier": verifier,
            "fields": result.fields, "wall_s": round(result.wall_s, 1),
            "modes": modes, "comparison": comparison(modes)}


def write_json(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def summary_lines(report: dict) -> list[str]:
    lines = []
    for name, mode in report["modes"].items():
        if not mode["available"]:
            lines.append(f"{name:10s} unavailable: {mode['reason']}")
            continue
        a = mode["aggregate"]
        b, t = a["breakdown_ms"], a["breakdown_ms_p95_tail"]
        preview = (f"; draft preview on {a['previewed_keys']} keys, {a['preview_ms_p50']}/"
                   f"{a['preview_ms_p95']} ms" if a["previewed_keys"] else "")
        lines.append(
            f"{name:10s} suggestion p50/p95 {a['suggest_ms_p50']}/{a['suggest_ms_p95']} ms "
            f"(first token {a['first_token_ms_p50']}/{a['first_token_ms_p95']} ms{preview}), "
            f"whole before the next key {a['full_fraction']}, forwards/key "
            f"{a['forwards_per_keystroke']} ({a['forwards_source']}), tokens computed/key "
            f"{a['tokens_computed_per_keystroke']}, cancelled {a['cancelled']['suggestions']}, "
            f"errors {a['errors'] or 0}; draft/network/verify/other ms {b['draft']}/"
            f"{b['network']}/{b['verify']}/{b['other']}, at the p95 and over "
            f"{t['draft']}/{t['network']}/{t['verify']}/{t['other']}")
        if (o := mode["outage"]) is not None:
            down = o["phases"]["down"]
            lines.append(
                f"{'':10s} outage {o['down_s']} s: {down['suggestions_shown']}/"
                f"{down['keystrokes']} keys got a suggestion ({down['unverified_suggestions']} "
                f"unverified); all verified after: {o['all_verified_after_recovery']}; "
                f"client errors {o['client_errors']}")
    return lines
