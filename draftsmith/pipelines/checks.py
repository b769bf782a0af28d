"""What a pipeline dry run checks against the target's own ``config.json``.

Parsing each section with its stage's parser catches bad types and names; these checks
catch values that parse but cannot work for this target: an architecture vLLM cannot tap
(vLLM's own registry says so), tapped layer ids past its depth,
a draft vocabulary larger than its vocabulary, lengths past its context. Each failure is
one line naming the option, the value, the target's fact and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from draftsmith import drafters
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.targets import EMBEDDED, TargetInfo, read_target, validate_layer_ids
from draftsmith.pipelines.commands import COMMANDS
from draftsmith.pipelines.config import STAGES, PipelineConfig, PipelineError


def check_refusals(cfg: PipelineConfig, target: TargetInfo) -> None:
    """What no stage could do for this target, refused before any engine starts: a target vLLM
    cannot tap, a kind that cannot train for it, and what a stage's ``target`` hook refuses
    (eval: a ``target_mtp`` baseline for a target without MTP layers)."""
    if not cfg.data and (refusal := target.eagle3_refusal):
        raise PipelineError(
            f"model: {target.architecture} cannot be tapped: {refusal}; draftsmith trains "
            "heads for targets vLLM implements SupportsEagle3 for"
        )
    model: dict[str, Any] = (cfg.train or {}).get("model") or {}
    try:  # a kind that cannot train for this target says so before the extraction runs
        drafters.get(str(model.get("kind", "eagle3"))).check_target(target, model)
    except DraftsmithError as err:
        raise PipelineError(f"train.{err}") from None
    for stage in STAGES:
        hook = COMMANDS[stage].hook("target")
        try:
            if hook is not None:
                hook(getattr(cfg, stage) or {}, target)
        except DraftsmithError as err:
            raise PipelineError(f"{stage}.{err}") from None


def check_against_target(cfg: PipelineConfig, offline: bool = True) -> list[str]:
    """Lines saying what was checked; raises :class:`PipelineError` on the first problem.

    ``offline`` (a dry run): a hub id is reported as unchecked, not fetched; the run itself
    (``offline=False``) reads the target's config before any engine starts."""
    local = Path(cfg.model).expanduser().exists() or cfg.model.lower() in EMBEDDED
    if offline and not local:  # a hub id: a dry run reaches no network
        return [f"target   unchecked: {cfg.model} is a hub id (the run checks its config.json)"]
    target = read_target(cfg.model)
    check_refusals(cfg, target)
    n, vocab = target.num_hidden_layers, target.vocab_size
    context = target.max_position_embeddings
    problems: list[str] = []

    ids = (cfg.extract or {}).get("layer_ids")
    if ids is not None and not cfg.data:
        try:
            validate_layer_ids(list(ids), n)
        except DraftsmithError as err:
            problems.append(f"extract.{err}")

    model: dict[str, Any] = (cfg.train or {}).get("model") or {}
    draft_vocab = model.get("draft_vocab_size")
    if isinstance(draft_vocab, int) and draft_vocab > vocab:
        problems.append(
            f"train.model.draft_vocab_size: {draft_vocab} is larger than the target's "
            f"vocabulary ({vocab}); give at most {vocab}, or null for the default"
        )

    if context:
        longest = (cfg.extract or {}).get("max_length")
        if isinstance(longest, int) and longest > context:
            problems.append(
                f"extract.max_length: {longest} is past the target's context "
                f"(max_position_embeddings {context}); give at most {context}"
            )
        reply = (cfg.eval or {}).get("max_tokens")
        if isinstance(reply, int) and reply >= context:
            problems.append(
                f"eval.max_tokens: {reply} leaves no room for a prompt in the target's "
                f"context ({context}); give less"
            )
    if problems:
        raise PipelineError(f"{problems[0]}" + (f" (and {len(problems) - 1} more)" if
                                                  len(problems) > 1 else ""))  # fmt: skip
    return [
        f"target   ok  -> {target.architecture}: {n} layers, vocabulary {vocab:,}, context "
        f"{context or 'unknown'}; layer ids, draft vocabulary and lengths fit"
    ]
