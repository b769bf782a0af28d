"""Options of the evaluate stage (each field's docstring is its ``--help`` text)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from draftsmith.core.engine import EngineOptions
from draftsmith.core.errors import ConfigError


@dataclass
class EvalConfig:
    """Measure a draft head in vLLM: acceptance, speed against baselines, losslessness."""

    model: str = "smollm2-135m"
    """Target: a Hugging Face model directory, a hub id, or an embedded name (smollm2-135m)."""
    head: str | None = None
    """Draft head directory in vLLM's format (from `draftsmith export`); null: baselines only."""
    method: str | None = None
    """How vLLM runs the head: eagle3 (fused low/mid/high states), eagle (EAGLE-1), dflash
    (a block drafted in one pass), peagle (EAGLE-3 drafting every position in one pass,
    vLLM's parallel_drafting), or another registered kind's method; null: the kind the
    head's config.json names."""
    k: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5])
    """Draft lengths (num_speculative_tokens) to report."""
    derive_k: bool = True
    """Run only the largest k and derive smaller k's acceptance from its per-position
    counters (one engine per method instead of one per k; no timing for derived rows)."""
    datasets: list[str] | str = field(default_factory=lambda: ["mt_bench", "humaneval"])
    """Prompt sets: mt_bench, humaneval, sharegpt@heldout (ShareGPT first turns training on
    `sharegpt` never sees), JSON/JSONL files, `hf:<id or dir>[@split]`; the first user turn
    of each row is the prompt. sharegpt:long@heldout: long multi-turn conversations cut to
    each of `context_buckets`."""
    limit: int | None = None
    """Use at most this many prompts per dataset (per context bucket for a long set)."""
    context_buckets: list[int] = field(default_factory=list)
    """Prompt lengths, in tokens, at which to measure acceptance by context length: each
    `sharegpt:long` dataset (long ShareGPT conversations, chunks joined) becomes one dataset
    per bucket, `<spec>/ctx<tokens>`, its prompts cut to that many tokens and ending on a
    user turn. A bucket past the target's limit (max_position_embeddings - max_tokens - 8)
    is cut to it. [] (the default): no long set. E.g. [1024, 2048, 4096, 8192]."""
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    """Sampling temperatures, each measured on the same prompts (chat is served sampled); the
    lossless check uses the greedy (0.0) runs."""
    draft_sample_method: Literal["greedy", "probabilistic"] | None = None
    """How vLLM draws the head's (or draft model's) drafts at temperature > 0: greedy (argmax,
    draft probabilities taken as one-hot) or probabilistic (sampled, full draft probabilities
    in the rejection test); null: vLLM's default (greedy in 0.32). Refused when the installed
    vLLM lacks the option or the value; the report names what ran."""
    expected_acceptance: bool = True
    """Recompute the head's drafts in torch on the served replies (its kind's replica: EAGLE-3,
    P-EAGLE, EAGLE-1, DFlash, DSpark) and report served acceptance against expected (each
    draft's acceptance probability at the temperature: the target's probability of a greedy
    draft, sum_x min(p, q) of a probabilistic one), flagging gaps over 5%. One target forward
    per reply (seconds on CPU). A head vLLM cannot serve here is simulated this way anyway."""
    sampling_check: bool = False
    """At each temperature > 0, sample the first `sampling_check_tokens` reply tokens
    `sampling_check_samples` times for `sampling_check_prompts` prompts with every method and
    with no speculation, and test that the distributions match (chi-square, offline mode)."""
    sampling_check_prompts: int = 4
    """Prompts (the first of the first dataset) the sampling check uses."""
    sampling_check_samples: int = 400
    """Samples per prompt and method in the sampling check."""
    sampling_check_tokens: int = 2
    """Leading reply tokens compared as one outcome (the first is sampled before any draft,
    so at least 2 are needed to see speculation)."""
    max_tokens: int = 256
    """Longest reply, in tokens."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables for the target's chat template, as in extract (e.g.
    {enable_thinking: false} for Qwen3): offline they render the prompts, online they go
    in each request, as a chat client sends them."""
    concurrency: int = 1
    """Requests in flight at once (offline: vLLM's max_num_seqs); report it beside speeds."""
    baselines: list[Literal["none", "ngram", "suffix", "target_mtp"]] = field(
        default_factory=lambda: ["none", "ngram"]
    )
    """Methods measured on the same prompts in the same run: none (no speculation), ngram
    (prompt lookup), suffix (needs arctic-inference), target_mtp (the MTP layer the target
    ships, vLLM's method mtp without a draft model: before fine-tuning, beside an mtp head)."""
    ngram_lookup: tuple[int, int] = (2, 4)
    """ngram's prompt_lookup_min and prompt_lookup_max."""
    draft_model: str | None = None
    """Optional small draft model directory measured as vLLM's `draft_model` method."""
    mode: Literal["offline", "server"] = "offline"
    """offline: vllm.LLM in this process; server: `vllm serve` on 127.0.0.1 (OpenAI API)."""
    lossless: bool = True
    """Compare greedy outputs of every speculative method with no speculation, token for token."""
    time_limit: float | None = None
    """Seconds the evaluation may take (the pipeline's time_budget sets it, and sizes the
    prompts so that every engine fits): suffix decoding runs right after no speculation and
    is skipped only when even then its engine would end past the limit (predicted as long as
    no speculation's, ``runs.predicted_s``), listed in results.json's ``skipped``. No
    speculation, the head and ngram always run."""
    train_data: str | None = None
    """The extracted dataset the head was trained on (the pipeline fills it in): eval refuses,
    before any engine starts, prompt sets with exact or near-duplicate prompts in it."""
    overlap_ngram: int = 8
    """Tokens per n-gram of the overlap check."""
    overlap_threshold: float = 0.5
    """Share of a prompt's n-grams found in one training sample that counts as overlap."""
    output: str = "outputs/eval"
    """Directory for results.json, report.md and plots."""
    overwrite: bool = False
    """Write into `output` even if it is a file or a directory eval did not write."""
    wandb: bool = True
    """Log figures and tables to W&B (offline mode unless WANDB_API_KEY is set)."""
    seed: int = 0
    """Sampling seed of the engine."""
    engine: EngineOptions = field(default_factory=EngineOptions)
    """vLLM engine options (CUDA graphs stay on by default on GPU, eager on CPU)."""

    def __post_init__(self) -> None:
        self.datasets = [self.datasets] if isinstance(self.datasets, str) else self.datasets
        if not self.datasets:
            raise ConfigError("datasets: [] names no prompt set; give one, e.g. mt_bench")
        from draftsmith import drafters

        if self.method is not None and self.method not in drafters.head_methods():
            raise ConfigError(
                f"method: {self.method!r} is not a choice; use one of {drafters.head_methods()}"
            )
