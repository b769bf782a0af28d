"""An extraction stopped by SIGTERM: the one line it ends with, and exit status 143.

Inside ``core/signals.sigterm_raises`` the signal raises ``Terminated`` wherever the main
thread is (capturing, writing a shard); every file goes through ``core/files.write_atomic``,
so the shard in progress leaves nothing, and the engines close on the way out
(``engines.close_started``). What is on disk is whole shards with their sidecars: the same
command run again skips them (``manifest.shard_done``) and writes the rest.
"""

from __future__ import annotations

import sys
from pathlib import Path

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.signals import EXIT_SIGTERM


def shards_written(output: Path) -> tuple[int, int] | None:
    """``(finished, planned)`` shards of the dataset at ``output`` (every worker's), or
    None before a plan was written."""
    from draftsmith.dataset import manifest

    if not (output / manifest.PLAN_FILE).is_file():
        return None
    try:
        planned = manifest.read_plan(output)["shards"]
        done = sum(manifest.shard_done(output, k, ids) for k, ids in enumerate(planned))
    except DraftsmithError:  # a damaged plan: the rerun says so in its own line
        return None
    return done, len(planned)


def report_sigterm(prog: str, output: str | Path) -> int:
    """Print the one line for a run stopped by SIGTERM; return 143."""
    counts = shards_written(Path(output))
    kept = f"{counts[0]} of {counts[1]} shards" if counts else "no shard"
    print(
        f"{prog}: stopped by SIGTERM; {kept} written to {output}; run the same command "
        "again to go on",
        file=sys.stderr,
        flush=True,
    )
    return EXIT_SIGTERM
