"""Run the engine's protocol on N ranks as threads of this process (ThreadTransport)."""
from __future__ import annotations

import threading
from typing import Any, Callable

from raydcp.transport import ThreadTransport


def run_ranks(world: int, fn: Callable[[ThreadTransport], Any], timeout_s: float = 30.0) -> tuple[list, list]:
    """Call fn(transport) on every rank concurrently; returns (results, exceptions) by rank."""
    transports = ThreadTransport.group(world, timeout_s=timeout_s)
    results: list[Any] = [None] * world
    errors: list[BaseException | None] = [None] * world

    def go(r: int) -> None:
        try:
            results[r] = fn(transports[r])
        except BaseException as exc:  # collected and asserted on by the test
            errors[r] = exc

    threads = [threading.Thread(target=go, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 10)
    return results, errors
