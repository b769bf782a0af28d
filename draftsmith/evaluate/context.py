"""Acceptance by context length: eval's ``context_buckets``.

Each ``sharegpt:long`` dataset (:mod:`draftsmith.conversations.longctx`) becomes one dataset
per bucket, named ``<spec>/ctx<tokens>``: its prompts are long conversations rendered with
the target's chat template and cut to the bucket's token count, ending on a user turn
(``longctx.cut_to_context``). Every per-dataset figure (served counters, expected acceptance,
losslessness, the report's tables) then applies to each bucket unchanged; this module adds
the bucket to each run (``run["context"]``), the list of buckets to results.json
(``context_buckets``), the report's "By context length" table and its plot.

A bucket's prompt length is ``min(bucket, fit)``, where ``fit`` is the target's
``max_position_embeddings`` less ``max_tokens`` and 8 positions (the reply must fit too:
SmolLM2's 8,192 positions give an 8k bucket of 7,928 tokens with 256-token replies).
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from draftsmith.conversations.rows import DataError, SkipLog
from draftsmith.core.errors import ConfigError

SLACK = 8  # positions eval's engine adds past prompt + max_tokens (main.evaluate)


def bucket_name(spec: str, tokens: int) -> str:
    """The dataset name of one bucket: ``sharegpt:long@heldout/ctx4096``."""
    return f"{spec}/ctx{tokens}"


def check_buckets(datasets: list[str], buckets: list[int]) -> None:
    """Refuse buckets without a long set, a long set without buckets, and bad sizes."""
    from draftsmith.conversations.longctx import is_long

    long = [d for d in datasets if is_long(d)]
    if long and not buckets:
        raise ConfigError(f"datasets: {long[0]} needs context_buckets (prompt tokens per "
                          "bucket), e.g. context_buckets: [1024, 2048, 4096, 8192]")  # fmt: skip
    if buckets and not long:
        raise ConfigError(f"context_buckets: {buckets} needs a long prompt set in datasets; "
                          "add sharegpt:long@heldout")  # fmt: skip
    if any(b < 64 for b in buckets) or sorted(set(buckets)) != list(buckets):
        raise ConfigError(f"context_buckets: {buckets}; give distinct token counts >= 64 in "
                          "ascending order, e.g. [1024, 2048]")  # fmt: skip


def fit(cfg, target) -> int | None:
    """The longest prompt the target can serve with a whole reply (None: no stated limit)."""
    limit = target.max_position_embeddings
    return None if limit is None else limit - cfg.max_tokens - SLACK


def bucket_prompts(cfg, spec: str, tokenizer, target) -> tuple[dict, dict, dict, list[dict]]:
    """Per bucket of `spec`: sample ids, chat messages and prompt ids (as ``load_prompts``
    gives them), and results.json's ``context_buckets`` entries."""
    from draftsmith.conversations.longctx import cut_to_context
    from draftsmith.conversations.sources import load_conversations
    from draftsmith.conversations.template import render_prompt

    convs = load_conversations(spec, require_assistant=False, skips=SkipLog())
    room = fit(cfg, target)
    if room is not None and room < 64:
        limit = target.max_position_embeddings
        raise ConfigError(f"max_tokens: {cfg.max_tokens} leaves {room} prompt tokens of the "
                          f"target's {limit} positions; lower max_tokens")  # fmt: skip

    def render(msgs: list[dict]) -> list[int]:
        return render_prompt(tokenizer, msgs, kwargs=cfg.chat_template_kwargs)

    def tokenize(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    ids, chats, tokens, entries = {}, {}, {}, []
    for bucket in cfg.context_buckets:
        length = bucket if room is None else min(bucket, room)
        name = bucket_name(spec, bucket)
        ids[name], chats[name], tokens[name] = [], [], []
        for conv in convs:
            if cfg.limit is not None and len(ids[name]) >= cfg.limit:
                break
            cut = cut_to_context(conv.messages, length, render, tokenize, tokenizer.decode)
            if cut is not None:
                ids[name].append(conv.id)
                chats[name].append(cut[0])
                tokens[name].append(cut[1])
        if not ids[name]:
            raise DataError(f"context_buckets: no conversation of {spec} reaches {length} tokens; "
                            "use smaller buckets")  # fmt: skip
        lengths = [len(t) for t in tokens[name]]
        entries.append({
            "dataset": name,
            "source": spec,
            "bucket": bucket,
            "tokens": length,
            "prompts": len(lengths),
            "prompt_tokens_mean": sum(lengths) / len(lengths),
            "prompt_tokens_min": min(lengths),
            "prompt_tokens_max": max(lengths),
        })  # fmt: skip
    return ids, chats, tokens, entries


def annotate(records: list[dict], entries: list[dict]) -> None:
    """Tag each run of a bucket's dataset with ``run["context"]`` (its prompt tokens)."""
    tokens = {e["dataset"]: e["tokens"] for e in entries}
    for rec in records:
        if rec["dataset"] in tokens:
            rec["context"] = tokens[rec["dataset"]]


def by_context(runs: list[dict], method: str) -> dict[int, dict]:
    """context tokens -> `method`'s measured run at its largest k (derived rows aside)."""
    out: dict[int, dict] = {}
    for r in runs:
        if r["method"] != method or r.get("context") is None or r.get("derived_from_k"):
            continue
        if r.get("tokens_per_step") is None and r.get("acceptance_length") is None:
            continue
        if r["context"] not in out or (r["k"] or 0) > (out[r["context"]]["k"] or 0):
            out[r["context"]] = r
    return out


def expected_tokens_per_step(run: dict) -> float | None:
    """Tokens per step had the head's acceptance been the expected one: served tokens per
    step scaled by expected over served acceptance length (the verification steps are
    the reply's tokens over its acceptance length)."""
    e = run.get("expected") or {}
    got, want, tps = e.get("served_per_draft"), e.get("expected_per_draft"), run["tokens_per_step"]
    if got is None or want is None or tps is None:
        return None
    return tps * (1 + want) / (1 + got)


def figures_by_context(results: dict, method: str) -> dict[str, dict[int, dict]]:
    """At the lowest temperature: ``{"head" | "ngram" | "suffix": {context tokens:
    {"tokens_per_step", "expected_tokens_per_step", "k", "temperature"}}}`` (what a study
    tabulates)."""
    if not results.get("context_buckets") or not results.get("runs"):
        return {}
    coolest = min(r["temperature"] for r in results["runs"])
    runs = [r for r in results["runs"] if r["temperature"] == coolest]
    out: dict[str, dict[int, dict]] = {}
    for name, m in (("head", method), ("ngram", "ngram"), ("suffix", "suffix")):
        found = by_context(runs, m)
        if found:
            out[name] = {
                tokens: {
                    "tokens_per_step": r["tokens_per_step"],
                    "expected_tokens_per_step": expected_tokens_per_step(r),
                    "k": r["k"],
                    "temperature": coolest,
                }
                for tokens, r in found.items()
            }
    return out


def _f(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def markdown_lines(results: dict, method: str | None) -> list[str]:
    """report.md's "By context length" section: one table per temperature."""
    entries = {e["tokens"]: e for e in results.get("context_buckets") or []}
    if not entries:
        return []
    lines = ["", "## By context length", "",
             "Tokens per step (output tokens per target step) of each method at its largest k, "
             "per context bucket (prompt tokens: long ShareGPT conversations cut to the "
             "bucket, ending on a user turn). Expected: the head's drafts replayed in torch on "
             "the served replies; gap: served / expected accepted per draft - 1."]  # fmt: skip
    others = [m for m in ("ngram", "suffix") if any(r["method"] == m for r in results["runs"])]
    for temperature in sorted({r["temperature"] for r in results["runs"]}):
        runs = [r for r in results["runs"] if r["temperature"] == temperature]
        head = by_context(runs, method) if method else {}
        base = {m: by_context(runs, m) for m in others}
        header = ["context tokens", "prompts"]
        if method:
            header += [f"{method} tok/step", "expected", "gap"]
        header += [f"{m} tok/step" for m in others]
        lines += ["", f"Temperature {float(temperature)}:", "",
                  "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]  # fmt: skip
        for tokens, entry in sorted(entries.items()):
            row = [f"{tokens:,} ({entry['bucket']:,} bucket)", str(entry["prompts"])]
            if method:
                r = head.get(tokens)
                gap = ((r.get("expected") or {}).get("relative_gap")) if r else None
                flag = (r.get("expected") or {}).get("flag") if r else None
                row += [
                    f"{_f(r['tokens_per_step'])} (k={r['k']})" if r else "–",
                    _f(expected_tokens_per_step(r)) if r else "–",
                    "–" if gap is None else f"{100 * gap:+.1f}%" + (f" ({flag})" if flag else ""),
                ]
            for m in others:
                r = base[m].get(tokens)
                row.append(f"{_f(r['tokens_per_step'])} (k={r['k']})" if r else "–")
            lines.append("| " + " | ".join(row) + " |")
    return lines


def plot_by_context(runs: list[dict], method: str, title: str, path: Path) -> bool:
    """Lines: tokens per step against context tokens, the head served and expected, ngram
    and suffix (each at its largest k)."""
    head = {x: r for x, r in by_context(runs, method).items() if r["tokens_per_step"]}
    if not head:  # simulated rows have no tokens per step
        return False
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.add_subplot()
    xs = sorted(head)
    ax.plot(xs, [head[x]["tokens_per_step"] for x in xs], "o-", label=f"{method} (served)")
    want = [(x, expected_tokens_per_step(head[x])) for x in xs]
    want = [(x, y) for x, y in want if y is not None]
    if want:
        ax.plot(*zip(*want, strict=True), "s--", mfc="none", label=f"{method} (expected)")
    for name, mark in (("ngram", "x:"), ("suffix", "+-.")):
        rows = {x: r for x, r in by_context(runs, name).items() if r["tokens_per_step"]}
        if rows:
            bx = sorted(rows)
            ax.plot(bx, [rows[x]["tokens_per_step"] for x in bx], mark, ms=9, label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [f"{x:,}" for x in xs])
    ax.set(xlabel="context (prompt tokens)", ylabel="tokens / step")
    ax.set_title(f"{method}: tokens per step by context length {title}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)
    return True
