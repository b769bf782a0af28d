"""Options of the extract stage (each field's docstring is its ``--help`` text)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from draftsmith.core.engine import EngineOptions
from draftsmith.core.errors import ConfigError

# What vLLM's chat endpoint sets itself (a request's chat_template_kwargs cannot).
RESERVED_KWARGS = frozenset(
    {"add_generation_prompt", "continue_final_message", "tools", "tokenize", "chat_template"}
)


@dataclass
class ExtractConfig:
    """Capture a target's hidden states with vLLM into a sharded safetensors dataset."""

    model: str = "smollm2-135m"
    """Target: a Hugging Face model directory, a hub id, or an embedded name (smollm2-135m)."""
    data: list[str] | str = field(default_factory=lambda: ["self:64"])
    """Sources, in order: JSON/JSONL files (ShareGPT or OpenAI shape), `hf:<id or dir>[@split]`,
    `mt_bench`, `humaneval`, `sharegpt[:full|:code|:long][@train|@heldout]` (ShareGPT first
    turns; whole conversations with `:full`; programming first turns with `:code`; whole
    conversations with their chunks joined, for long contexts, with `:long`; `@heldout` is a
    fixed 2% slice), or `self:N` (N prompts the target writes itself)."""
    output: str = "outputs/extract"
    """Dataset directory; re-running the same command resumes it. A file, or a non-empty
    directory extract did not write, is refused (see `overwrite`)."""
    overwrite: bool = False
    """Write into `output` even if it is a file or a directory extract did not write (a file
    there is deleted; files of the same names are replaced)."""
    repair: bool = False
    """Check every finished shard of `output` against its recorded sha256, delete the shards
    that differ and extract exactly those again (the rest is kept). The settings are the
    dataset's own, read from its manifest.json: only `output`, `workers` and `worker` are
    taken from the command line."""
    encoding: str = "utf-8"
    """Text encoding of JSON / JSONL data files (e.g. latin-1, cp1252)."""
    layer_ids: list[int] | None = None
    """Layers to capture in vLLM's meaning (k = residual stream after k decoder layers, 0 =
    embeddings, N = last layer before the final norm); null = [2, N//2, N-3, N]."""
    kind: str | None = None
    """The drafter kind the data is for (`train`'s `model.kind`, e.g. dspark or mtp): a
    target that kind cannot train for is refused before any engine starts. Null: no check
    (the dataset serves any kind)."""
    regenerate: bool = False
    """Replace assistant turns with the target's own replies, written in the capturing pass.
    Conversations with tool calls keep their replies (the tools cannot be run here)."""
    keep_replies: float = 0.0
    """With `regenerate`, the share of conversations with assistant turns that keep their own
    replies (captured by prefill) instead of the target's: a mix of the corpus's replies and
    the target's, e.g. `data: sharegpt:full` with 0.5. Kept ones are spread evenly through
    the data, so a time limit cuts both kinds in proportion. 0 = the target answers all."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables for the target's chat template, e.g. `{enable_thinking: false}`: given
    to every render and every regenerated round's prompt, as vLLM's chat endpoint gives a
    request's `chat_template_kwargs`. Serve the head with the same ones."""
    keep_reasoning: bool = True
    """Train on the target's reasoning (`<think>...</think>`, harmony's analysis channel) as
    well as its answer. false: the reasoning stays in the sample (the target reads it before
    it answers) but out of the loss, which starts after the reasoning's end marker."""
    temperature: float = 0.0
    """Sampling temperature of regenerated replies (0 = greedy)."""
    max_new_tokens: int = 512
    """Longest regenerated reply, in tokens."""
    max_length: int = 2048
    """Longest stored sequence, in tokens."""
    overlong: Literal["truncate", "skip"] = "truncate"
    """What to do with a conversation over `max_length`: cut it, or skip it (counted). With
    `regenerate`, cutting ends a conversation at the last round whose prompt fits."""
    bad_rows: Literal["error", "skip"] = "error"
    """A malformed input row stops the run with a one-line error, or is skipped and counted."""
    limit: int | None = None
    """Use at most this many conversations (after skips)."""
    dtype: Literal["bfloat16", "float16", "float32", "fp8_e4m3"] = "bfloat16"
    """Storage dtype of hidden states; fp8_e4m3 (per-token scales) halves the disk of bf16."""
    samples_per_shard: int = 256
    """Samples per shard file (one engine call each); lower it for large targets."""
    workers: int = 1
    """Data-parallel extraction: total number of worker processes writing this dataset."""
    worker: int = 0
    """Index of this worker in [0, workers); it writes shards k with k % workers == worker."""
    time_limit: float | None = None
    """Seconds this run may take, engine starts included (the pipeline's time_budget sets
    it). No shard starts that would end past it: the shards written are whole, the manifest
    says ``stopped_by: time_limit``, and training reads them as a dataset. Re-running
    without the limit resumes the rest. Streaming, the producer closes the dataset there:
    the shards written so far are all it holds, training goes on over them, and a
    ``recapture`` producer writes only those again. null = no limit."""
    seed: int = 0
    """Seed for self-written prompts and sampled regeneration."""
    verify: int = 0
    """After extraction, recompute this many samples with transformers and fail above tolerance."""
    verify_tolerance: float | None = None
    """Largest allowed error relative to each layer's max |value|; null picks one per dtype."""
    staging_dir: str | None = None
    """Scratch directory for the connector's per-request files; null = /dev/shm when present."""
    stream: bool = False
    """Produce for a streamed trainer (``data.stream`` in train): write the shards it asks
    for, in its order, never more than its disk bound ahead; exit when it finishes. Start it
    beside the trainer, on this machine or any that sees ``output`` (docs/scaling.md)."""
    trainer_timeout: float = 900.0
    """Streaming: seconds without a word from the trainer before this producer exits."""
    engine: EngineOptions = field(default_factory=EngineOptions)
    """vLLM engine options."""

    def __post_init__(self) -> None:
        self.data = [self.data] if isinstance(self.data, str) else list(self.data)
        if not self.data:
            raise ConfigError("data: [] names no source; give one, e.g. sharegpt or chats.jsonl")
        reserved = sorted(RESERVED_KWARGS & set(self.chat_template_kwargs or {}))
        if reserved:
            raise ConfigError(
                f"chat_template_kwargs: {reserved} are set by extract itself, as vLLM's chat "
                "endpoint sets them; remove them."
            )
