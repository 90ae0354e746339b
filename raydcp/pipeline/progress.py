"""A progress bar for long pipeline stages (replication of large checkpoints, in jobs)."""
from __future__ import annotations

import sys
import time

from ..errors import CheckpointError
from .status import StatusRecord

__all__ = ["wait_with_progress"]


def wait_with_progress(driver, name: str, timeout: float | None = None, *, interval_s: float = 0.25) -> StatusRecord:
    """Wait for ``name``'s pipeline, drawing the running stage's bytes on stderr when it is a
    terminal (in logs and pipes this is a plain wait)."""
    from rich.console import Console

    console = Console(file=sys.stderr)
    if not console.is_terminal:
        return driver.wait(name, timeout)
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    deadline = None if timeout is None else time.monotonic() + timeout
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task(f"{name}: waiting", total=None)
        while True:
            try:
                return driver.wait(name, interval_s)
            except CheckpointError:
                if deadline is not None and time.monotonic() > deadline:
                    raise
            p = driver.progress(name)
            if p:
                bar.update(task, description=f"{name}: {p['stage']}", completed=p.get("done_bytes") or 0,
                           total=p.get("total_bytes"))
