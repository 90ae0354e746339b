"""Operating the memory tier (``raymem://``) from Python: what ``raydcp mem ls|rm|usage|stop`` does.

With ``mem = raydcp.memory``:

```python
mem.connect()                                  # RAY_ADDRESS or the local cluster, within 15 s
for c in mem.checkpoints():                    # every checkpoint directory held in memory
    print(c.url, c.step, c.bytes, c.committed_at)
mem.remove("raymem://run-7/step-100")          # one checkpoint; raymem://run-7: the whole NAME
mem.usage()                                    # per node: bytes held and reserved
mem.stop()                                     # the holders and the coordinator hosts
```

See docs/memory.md, "Operating the memory tier". The implementation is
:mod:`raydcp.runtime.memstore.admin`.
"""
from __future__ import annotations

from .runtime.memstore.admin import (DEFAULT_TIMEOUT_S, ClusterUnreachableError, MemCheckpoint, MemoryInUseError,
                                     NodeUsage, Removal, Stopped, checkpoints, connect, remove, stop, usage)

__all__ = ["DEFAULT_TIMEOUT_S", "ClusterUnreachableError", "MemoryInUseError", "MemCheckpoint", "NodeUsage",
           "Removal", "Stopped", "connect", "checkpoints", "remove", "usage", "stop"]
