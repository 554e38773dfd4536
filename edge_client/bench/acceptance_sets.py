"""The prompt sets of ``edgespec-bench acceptance`` and its printed report.

Two sets, reported in this order:

- ``realistic``: the hand-written eval set (``edge_client.bench.eval_set``, kept apart from all
  training data), by category. A one-turn prompt is rendered with the chat template, a
  multi-turn one with the chat template over all its turns (``apply_chat_template(messages)``),
  an IME prefix is raw text (no template).
- ``heldout``: the distillation's held-out split, templated like its training data; still
  reported, with the report's original keys, for continuity with earlier runs.

No torch here: the measurement is in ``edge_client.bench.acceptance``.
"""

from __future__ import annotations

from dataclasses import dataclass

SETS = ("realistic", "heldout")  # the order they run and print in
REALISTIC_SOURCE = "edge_client/bench/eval_prompts"
HEADLINE_K = 4


@dataclass(frozen=True)
class BenchPrompt:
    ids: list[int]
    truncated: bool  # cut from the left to fit the context
    category: str = ""


def _evenly(items: list, limit: int | None) -> list:
    """``limit`` evenly spaced items (the lists are grouped by kind and topic)."""
    if limit is None or limit >= len(items):
        return list(items)
    return [items[i * len(items) // limit] for i in range(limit)]


def ordered_sets(names) -> list[str]:
    """The requested sets, deduplicated, realistic first."""
    return [s for s in SETS if s in set(names)]


# --------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------


def load_heldout_prompts(limit: int | None) -> tuple[list[tuple[str, bool, str]], str]:
    """(text, chat, kind) triples and where they came from: the distillation's held-out split
    when that module exists, the project's built-in chat prompts otherwise.

    A limit takes evenly spaced prompts rather than the first ones, because the split lists
    its prompts grouped by kind and topic.
    """
    try:
        from edge_client.tools.distill.prompts import prompt_split
    except ImportError:
        from shared.prompts import CHAT_PROMPTS

        prompts = [(text, True, "chat") for text in CHAT_PROMPTS]
        source = "shared.prompts.CHAT_PROMPTS"
    else:
        prompts = [(p.text, bool(p.chat), p.kind) for p in prompt_split("heldout")]
        source = "edge_client.tools.distill.prompts.prompt_split('heldout')"
    return _evenly(prompts, limit), source


def encode_prompts(tokenizer, prompts: list[tuple[str, bool, str]],
                   max_len: int) -> list[BenchPrompt]:
    out = []
    for text, chat, kind in prompts:
        ids = tokenizer.encode_chat(text) if chat else tokenizer.encode(text)
        if not ids:
            raise ValueError(f"prompt {text[:40]!r} encodes to no tokens")
        out.append(BenchPrompt(ids[-max_len:], len(ids) > max_len, kind))
    return out


def load_realistic(limit: int | None) -> tuple[list, str]:
    """The realistic eval set, at most ``limit`` evenly spaced prompts per category."""
    from edge_client.bench.eval_set import CATEGORIES, load_eval

    prompts = [p for c in CATEGORIES for p in _evenly(load_eval([c]), limit)]
    return prompts, REALISTIC_SOURCE


def encode_eval(tokenizer, prompts: list, max_len: int) -> list[BenchPrompt]:
    """Chat prompts through the chat template over all their turns, IME prefixes raw."""
    out = []
    for p in prompts:
        ids = (tokenizer.encode(tokenizer.apply_chat_template(p.chat_messages())) if p.chat
               else tokenizer.encode(p.raw))
        if not ids:
            raise ValueError(f"eval prompt {p.id} encodes to no tokens")
        out.append(BenchPrompt(ids[-max_len:], len(ids) > max_len, p.category))
    return out


# --------------------------------------------------------------------------------------------
# The realistic set's figures
# --------------------------------------------------------------------------------------------


def headline(summary: dict, prompts: list[BenchPrompt]) -> dict:
    """A group's figures per drafter, from its full summary (``Accumulator.summary``):

    - greedy_alpha and sampled_alpha (T 0.7 / top-p 0.95): accepted / judged drafts in the
      measured rounds at ``--draft-len``;
    - tokens_per_round_k4: greedy, K = 4, by exact replay on the target's path (all rounds;
      ``tokens_per_full_round_k4``: rounds with K + 1 path tokens left);
    - target_forwards_per_token_k4 = rounds / tokens committed = 1 / tokens_per_round_k4, the
      target forwards each committed token costs (one verification forward per round, the
      prompt's prefill not counted; decoding without a draft costs 1.0).
    """
    k = str(HEADLINE_K)
    drafters = {}
    for name, d in summary["drafters"].items():
        tpr = d["greedy_tokens_per_round_by_k"][k]
        drafters[name] = {
            "greedy_alpha": d["greedy"]["alpha"],
            "greedy_judged": d["greedy"]["judged"],
            "sampled_alpha": d["sampled"]["alpha"],
            "sampled_judged": d["sampled"]["judged"],
            "tokens_per_round_k4": tpr,
            "tokens_per_full_round_k4": d["greedy_tokens_per_full_round_by_k"][k],
            "target_forwards_per_token_k4": 1 / tpr if tpr else None,
        }
    mv = summary["model_vs_target"]
    return {
        "prompts": len(prompts),
        "prompts_truncated": sum(p.truncated for p in prompts),
        "path_tokens": summary["path_tokens"],
        "drafters": drafters,
        "expected_sampled_alpha": mv["expected_sampled_alpha"],
        "greedy_top1_agreement": mv["greedy_top1_agreement"],
    }


def realistic_report(limit: int | None, prompts: list[BenchPrompt], by_category: dict,
                     overall: dict) -> dict:
    """``by_category``: category -> its full summary, in category order; ``overall``: the
    summary of all prompts pooled (counts added, not category means)."""
    return {
        "source": REALISTIC_SOURCE,
        "prompts": len(prompts),
        "per_category_limit": limit,
        "headline_k": HEADLINE_K,
        "categories": {
            c: {**headline(s, [p for p in prompts if p.category == c]), "detail": s}
            for c, s in by_category.items()},
        "overall": {**headline(overall, prompts), "detail": overall},
    }


# --------------------------------------------------------------------------------------------
# Printing
# --------------------------------------------------------------------------------------------


def _f(v, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def _sampling(c: dict) -> str:
    s = c["sampled"]
    return f"T {s['temperature']} / top-p {s['top_p']}"


def format_realistic(report: dict) -> list[str]:
    r, c = report["realistic"], report["config"]
    lines = [f"realistic set: {r['prompts']} prompts from {r['source']} "
             f"({len(r['categories'])} categories), {c['max_new_tokens']} new tokens; alphas "
             f"from the measured rounds at K = {c['draft_len']} (sampled = {_sampling(c)}); "
             f"tokens/round and target forwards/token: greedy, K = {r['headline_k']}, "
             "exact replay",
             "",
             "model draft:",
             "",
             "| category | prompts | tokens | greedy alpha (judged) | T=0.7 alpha (judged) | "
             "tok/round K=4 | target fwd/token K=4 | 1 - TV at T=0.7 |",
             "|---|---|---|---|---|---|---|---|"]
    rows = [*r["categories"].items(), ("**overall**", r["overall"])]
    for name, h in rows:
        m = h["drafters"]["model"]
        lines.append(f"| {name} | {h['prompts']} | {h['path_tokens']} | "
                     f"{_f(m['greedy_alpha'])} ({m['greedy_judged']}) | "
                     f"{_f(m['sampled_alpha'])} ({m['sampled_judged']}) | "
                     f"{_f(m['tokens_per_round_k4'], '.2f')} | "
                     f"{_f(m['target_forwards_per_token_k4'])} | "
                     f"{_f(h['expected_sampled_alpha'])} |")
    lines += ["", "overall, every drafter:", "",
              "| drafter | greedy alpha | T=0.7 alpha | tok/round K=4 | target fwd/token K=4 |",
              "|---|---|---|---|---|"]
    for name, m in r["overall"]["drafters"].items():
        lines.append(f"| {name} | {_f(m['greedy_alpha'])} | {_f(m['sampled_alpha'])} | "
                     f"{_f(m['tokens_per_round_k4'], '.2f')} | "
                     f"{_f(m['target_forwards_per_token_k4'])} |")
    return lines


def format_heldout(report: dict) -> list[str]:
    c = report["config"]
    lines = [f"held-out split (templated like the training data; for continuity): "
             f"{c['prompts']} prompts from {c['prompt_source']}, {c['max_new_tokens']} new "
             f"tokens, K = {c['draft_len']}, sampled = {_sampling(c)}",
             "",
             "| drafter | greedy alpha (judged) | sampled alpha (judged) | greedy tok/round | "
             "sampled tok/round | greedy alpha by position |",
             "|---|---|---|---|---|---|"]
    for name, d in report["drafters"].items():
        g, s = d["greedy"], d["sampled"]
        by_pos = " ".join(_f(p["alpha"], ".2f") for p in g["by_position"])
        lines.append(f"| {name} | {_f(g['alpha'])} ({g['judged']}) | {_f(s['alpha'])} "
                     f"({s['judged']}) | {_f(g['tokens_per_round'], '.2f')} | "
                     f"{_f(s['tokens_per_round'], '.2f')} | {by_pos} |")
    ks = list(next(iter(report["drafters"].values()))["greedy_tokens_per_round_by_k"])
    lines += ["", "| greedy tokens/round | " + " | ".join(f"K={k}" for k in ks) + " |",
              "|---|" + "---|" * len(ks)]
    for name, d in report["drafters"].items():
        for label, key in (("", "greedy_tokens_per_round_by_k"),
                           (" (full rounds)", "greedy_tokens_per_full_round_by_k")):
            by_k = d[key]
            lines.append(f"| {name}{label} | " + " | ".join(_f(by_k[k], ".2f") for k in ks)
                         + " |")
    lat, mv = report["latency"], report["model_vs_target"]
    lines += ["",
              f"per-token step (median): draft {_f(lat['draft_step_ms_median'], '.2f')} ms, "
              f"target {_f(lat['target_step_ms_median'], '.2f')} ms "
              f"(ratio {_f(lat['draft_over_target'])})",
              f"model draft vs target on the greedy path ({mv['positions']} positions): "
              f"KL(p||q) {_f(mv['kl_target_draft_mean'])}, TV {_f(mv['tv_mean'])}, "
              f"TV sampled {_f(mv['tv_sampled_mean'])} (expected sampled alpha "
              f"{_f(mv['expected_sampled_alpha'])}; verified as point masses "
              f"{_f(mv.get('expected_sampled_alpha_point_mass'))}), top-1 agreement "
              f"{_f(mv['greedy_top1_agreement'])}"]
    return lines


def format_report(report: dict) -> str:
    """The realistic set first, then the held-out split, each where the report has it."""
    parts = []
    if "realistic" in report:
        parts.append("\n".join(format_realistic(report)))
    if "drafters" in report:
        parts.append("\n".join(format_heldout(report)))
    return "\n\n".join(parts)
