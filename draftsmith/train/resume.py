"""A resume (``--ckpt_path``) never ignores an option.

Options that change what is trained (the kind, its options, the target, the tapped layers)
must equal the checkpoint's: a different value is refused in one line naming both. Options
of the optimisation that may change mid-run (learning rate, weight decay, the schedule's
shape) are applied to the restored optimizer and scheduler, and said in one line; without
this, Lightning restores the checkpoint's learning rate and the new one is silently lost.
Options of how a step is computed, not what it computes (``HOW``: the attention path,
compilation, the fused loss, the loss's chunk size) may change freely: a run moved from a CPU
to a GPU resumes. Trainer options (``max_steps``, ``max_time``, logging) are Lightning's and
apply as given.
"""

from __future__ import annotations

from typing import Any

from draftsmith.core.errors import ConfigError

MAY_CHANGE = ("lr", "weight_decay", "warmup_steps", "min_lr_ratio", "anneal_to_time_cap")
HOW = ("attention", "compile", "fused_loss", "loss_chunk_size")
# What the head's build recorded (``DraftModule.info``) that a resume must agree with.
BUILT = ("kind", "layer_ids", "aux_layer_ids", "teacher_layer_id", "head_kwargs")


def check_resume(saved: dict[str, Any], ours: dict[str, Any], saved_info: dict, info: dict) -> None:
    """Refuse a resume whose trained-what options differ from the checkpoint's.

    ``saved`` / ``ours``: the checkpoint's and this run's ``model`` hyper-parameters;
    ``saved_info`` / ``info``: what each build recorded (kind, tapped layers)."""
    free = (*MAY_CHANGE, *HOW, "target")
    fixed = sorted(k for k in set(saved) | set(ours) if k not in free)
    pairs = [(f"model.{k}", saved.get(k), ours.get(k)) for k in fixed]
    pairs += [(k, saved_info.get(k), info.get(k)) for k in BUILT if k in saved_info or k in info]
    for name, then, now in pairs:
        if _differs(then, now):
            raise ConfigError(
                f"--ckpt_path: the checkpoint was trained with {name}={then!r}, this run says "
                f"{now!r}; {name} changes what is trained, so a resume cannot take it: resume "
                "with the checkpoint's value, or start a new run without --ckpt_path"
            )


def _differs(a: Any, b: Any) -> bool:
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return list(a) != list(b)
    return a != b


def apply_changes(
    checkpoint: dict[str, Any], saved: dict[str, Any], ours: dict[str, Any]
) -> str | None:
    """Make the restored optimizer and scheduler follow this run's ``MAY_CHANGE`` options
    (edits ``checkpoint`` before Lightning restores them). Returns the line that says what
    changed, or None."""
    changed = [k for k in MAY_CHANGE if k in saved and _differs(saved[k], ours.get(k))]
    if not changed:
        return None
    for state in checkpoint.get("optimizer_states", []):
        for group in state.get("param_groups", []):
            if "lr" in changed:
                scale = group["lr"] / group.get("initial_lr", saved["lr"]) if saved["lr"] else 1.0
                group["initial_lr"], group["lr"] = ours["lr"], ours["lr"] * scale
            if "weight_decay" in changed:
                group["weight_decay"] = ours["weight_decay"]
    if "lr" in changed:
        for sched in checkpoint.get("lr_schedulers", []):
            if "base_lrs" in sched:
                sched["base_lrs"] = [ours["lr"]] * len(sched["base_lrs"])
    said = ", ".join(f"model.{k} {saved[k]} -> {ours.get(k)}" for k in changed)
    return f"resuming with {said} (applied from this step on)"
