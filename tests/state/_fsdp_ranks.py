"""A rank of a gloo world holding an FSDP2 (``fully_shard``) model and its AdamW, as a Ray actor.

Lives in an importable module (not a test file) so Ray workers can import it by name.
"""
from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist
import torch.nn as nn

import raydcp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Net(nn.Module):
    """Sizes that no world size of 2 or 3 divides evenly: uneven and (for 3 ranks) empty pieces."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 5)
        self.blocks = nn.ModuleList([nn.Linear(5, 5), nn.Linear(5, 5)])
        self.out = nn.Linear(5, 2)

    def forward(self, x):
        x = self.inp(x)
        for blk in self.blocks:
            x = torch.tanh(blk(x))
        return self.out(x)


class FsdpRank:
    """``setup`` builds the world, the sharded model (initial weights from ``seed``) and a fresh
    AdamW; every collective method must be called on every rank of the world at once."""

    def setup(self, rank: int, world: int, port: int, seed: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        self.rank, self.world = rank, world
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(seed)
        model = Net()
        for blk in model.blocks:
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        self.optim = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)

    def train(self, steps: int) -> None:
        g = torch.Generator().manual_seed(100 + self.rank)  # each rank its own batches
        for _ in range(steps):
            self.optim.zero_grad()
            self.model(torch.randn(4, 6, generator=g)).pow(2).mean().backward()
            self.optim.step()

    def gathered(self) -> dict[str, torch.Tensor]:
        """Every parameter and Adam state tensor, whole (collective), keyed ``<fqn>`` / ``<fqn>/<name>``."""
        out = {}
        for fqn, p in self.model.named_parameters():
            out[fqn] = p.full_tensor().clone()
            for name, v in self.optim.state.get(p, {}).items():
                out[f"{fqn}/{name}"] = (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
        return out

    def run_snippet(self, code: str, path: str) -> None:
        """Execute ``code`` as this rank, with its model and optimizer as the state dict."""
        ns = {"raydcp": raydcp, "rank": self.rank, "world_size": self.world, "path": path,
              "state_dict": {"model": self.model, "optim": self.optim}}
        exec(compile(code, "group snippet", "exec"), ns)

    def load(self, path: str, group_name: str) -> list:
        stats = raydcp.load({"model": self.model, "optim": self.optim}, path,
                            group=raydcp.Group(group_name, self.rank, self.world, timeout_s=120))
        return [stats.bytes_read, bool(stats.skipped)]

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
