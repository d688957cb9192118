"""Progress bars for long-running commands: on local rank 0 only, never in a timed region.

``rich`` draws them on stderr. ``auto_refresh`` is off, so no drawing thread competes with
what is being measured: the bar is redrawn only when the caller advances it, between
timed samples. Other ranks (``LOCAL_RANK`` != 0) and non-terminal stderr get a no-op.
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Callable, Iterator


def _local_rank_zero() -> bool:
    return os.environ.get("LOCAL_RANK", "0").strip() in ("", "0")


@contextmanager
def progress(total: int, description: str) -> Iterator[Callable[[int], None]]:
    """Yield ``advance(n=1)``; a transient rich bar on stderr when it is a terminal on rank 0."""
    if not (_local_rank_zero() and sys.stderr.isatty()):
        yield lambda n=1: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=Console(stderr=True), auto_refresh=False, transient=True)
    with bar:
        task = bar.add_task(description, total=total)

        def advance(n: int = 1) -> None:
            bar.advance(task, n)
            bar.refresh()

        yield advance
