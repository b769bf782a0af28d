"""The `draftsmith` command: one subcommand per stage, each calling that stage's `main`.

draftsmith extract --config configs/extract/smollm2.yaml
draftsmith train fit --config configs/train/smollm2.yaml
draftsmith export --checkpoint CKPT --output DIR
draftsmith convert --head SRC --to sglang --output DST [--model TARGET]
draftsmith eval --config configs/eval/smollm2.yaml --head DIR
draftsmith pipeline --config configs/pipelines/smollm2.yaml --verbose

``--verbose`` (anywhere, or ``DRAFTSMITH_VERBOSE=1``) shows vLLM's and Lightning's logs
live instead of writing them to each stage's log file.
"""

from __future__ import annotations

import os
import sys

from draftsmith.core.console import VERBOSE_ENV
from draftsmith.pipelines.commands import COMMANDS


def usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {cmd.help}" for name, cmd in COMMANDS.items())
    return (
        f"usage: draftsmith <command> [--config FILE] [options] [--verbose]\n\n"
        f"commands:\n{rows}\n\n"
        f"`draftsmith <command> --help` lists a command's options; --verbose shows vLLM's\n"
        f"and Lightning's logs live (by default each stage writes them to a .log file).\n"
    )


def main(args: list[str] | None = None) -> int:
    from_argv = args is None
    args = sys.argv[1:] if from_argv else list(args)
    if "--verbose" in args:
        args.remove("--verbose")
        os.environ[VERBOSE_ENV] = "1"
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        choices = ", ".join(COMMANDS)
        print(f"draftsmith: error: unknown command {name!r}; use one of: {choices} "
              "(`draftsmith --help` says what each does)", file=sys.stderr)  # fmt: skip
        return 2
    stage_main = COMMANDS[name].main()
    if from_argv:  # the stage reads sys.argv itself (LightningCLI insists on one source)
        sys.argv = [f"draftsmith {name}", *rest]
        return stage_main() or 0
    return stage_main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
