"""The `draftsmith` command: one subcommand per stage, each calling that stage's `main`.

draftsmith extract --config configs/extract/smollm2.yaml
draftsmith train fit --config configs/train/smollm2.yaml
draftsmith export --checkpoint CKPT --output DIR
draftsmith eval --config configs/eval/smollm2.yaml --head DIR
draftsmith bench-extract --help
"""

from __future__ import annotations

import importlib
import sys

STAGES = {
    "extract": ("draftsmith.extract.main", "capture target hidden states into a dataset"),
    "train": ("draftsmith.train.main", "train a draft head (LightningCLI: fit, validate)"),
    "export": ("draftsmith.train.checkpoint", "write a trained head as a directory vLLM serves"),
    "eval": ("draftsmith.evaluate.main", "measure a head's acceptance and speed in vLLM"),
    "pipeline": ("draftsmith.pipelines.main", "extract -> train -> export -> eval, resumable"),
    "study": ("draftsmith.pipelines.study", "vary one knob at a time, measure each head in vLLM"),
    "bench-train": ("draftsmith.train.bench", "time training steps of a head (tokens/s, memory)"),
    "bench-extract": (
        "draftsmith.extract.bench",
        "time extraction against plain generation and HF",
    ),
}


def usage() -> str:
    width = max(map(len, STAGES))
    rows = "\n".join(f"  {name:<{width}}  {help_}" for name, (_, help_) in STAGES.items())
    return f"usage: draftsmith <command> [--config FILE] [options]\n\ncommands:\n{rows}\n"


def main(args: list[str] | None = None) -> int:
    from_argv = args is None
    args = sys.argv[1:] if from_argv else args
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in STAGES:
        print(f"draftsmith: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(STAGES[name][0])
    if from_argv:  # the stage reads sys.argv itself (LightningCLI insists on one source)
        sys.argv = [f"draftsmith {name}", *rest]
        return module.main() or 0
    return module.main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
