"""The raydcp demo, on an embedded local Ray instance.

1. Train a small model with AdamW for a few steps (the reference run).
2. Two Ray actors, each holding a dim-0 shard of every parameter and optimizer
   tensor (FSDP-style), save one checkpoint together.
3. Three Ray actors load it into a different sharding (dim-0 chunks of 3): the
   coordinator plans which bytes each reads; pieces move through the object store.
4. Every value is verified against the reference, and training resumed from the
   checkpoint matches the uninterrupted run.

Run: make demo   (or: .venv/bin/python jobs/demo.py [--dir PATH])
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import ray
import torch
from rich.console import Console
from rich.table import Table

import raydcp

console = Console()


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))


def train(model, opt, steps: int, start: int = 0) -> float:
    loss = torch.tensor(0.0)
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    return loss.item()


def full_state(model, opt) -> dict[str, torch.Tensor]:
    """Flat name -> full tensor of the model parameters and AdamW moments."""
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, s in opt.state.items():
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"optim.{names[id(p)]}.{k}"] = s[k].clone()
    return out


def dim0_shard(t: torch.Tensor, world: int, rank: int) -> raydcp.Shard:
    pieces = torch.chunk(t, world) if t.dim() else [t]
    lo = sum(p.shape[0] for p in pieces[:rank]) if t.dim() else 0
    local = pieces[rank] if rank < len(pieces) else t.narrow(0, t.shape[0], 0)
    return raydcp.Shard(local.clone(), (lo,) + (0,) * (t.dim() - 1), tuple(t.shape))


@ray.remote(num_cpus=0)
class Trainer:
    """One rank: holds its shard of every tensor, saves or loads with its group."""

    def __init__(self, rank: int, world: int, group_name: str):
        self.rank, self.world = rank, world
        self.group = raydcp.Group(group_name, rank, world, timeout_s=120)
        self.state: dict = {}

    def hold(self, full: dict, step: int) -> int:
        self.state = {k: dim0_shard(v, self.world, self.rank) for k, v in full.items()}
        self.state["step"] = step
        return sum(s.tensor.numel() for s in self.state.values() if isinstance(s, raydcp.Shard))

    def save(self, path: str) -> int:
        return raydcp.save(self.state, path, group=self.group).total_bytes

    def load(self, path: str, shapes: dict) -> dict:
        empty = {k: torch.empty(shape) for k, shape in shapes.items()}
        self.state = {k: dim0_shard(v, self.world, self.rank) for k, v in empty.items()}
        self.state["step"] = -1
        stats = raydcp.load(self.state, path, group=self.group)
        return {"bytes_read": stats.bytes_read, "bytes_needed": stats.bytes_needed, "step": self.state["step"]}

    def check(self, full: dict) -> list[str]:
        bad = []
        for k, v in full.items():
            want = dim0_shard(v, self.world, self.rank)
            got = self.state[k]
            if got.offsets != want.offsets or not torch.equal(got.tensor, want.tensor):
                bad.append(k)
        return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="where to write the checkpoint (default: a temporary directory)")
    args = ap.parse_args(argv)
    root = args.dir or tempfile.mkdtemp(prefix="raydcp-demo-")
    path = os.path.join(root, "step-5")

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, 5)
    full = full_state(model, opt)
    shapes = {k: tuple(v.shape) for k, v in full.items()}
    console.print(f"[bold]raydcp demo[/]: {len(full)} tensors, checkpoint at {path}")

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        t0 = time.perf_counter()
        savers = [Trainer.remote(r, 2, "demo-save") for r in range(2)]
        ray.get([s.hold.remote(full, 5) for s in savers])
        sizes = ray.get([s.save.remote(path) for s in savers])
        t_save = time.perf_counter() - t0

        t0 = time.perf_counter()
        loaders = [Trainer.remote(r, 3, "demo-load") for r in range(3)]
        stats = ray.get([ld.load.remote(path, shapes) for ld in loaders])
        t_load = time.perf_counter() - t0
        bad = sum(ray.get([ld.check.remote(full) for ld in loaders]), [])
    finally:
        ray.shutdown()

    md = raydcp.read_metadata(path)
    table = Table(title="2 ranks saved -> 3 ranks loaded (dim-0 shards)")
    for col in ("rank", "bytes read", "bytes needed", "step"):
        table.add_column(col, justify="right")
    for r, s in enumerate(stats):
        table.add_row(str(r), f"{s['bytes_read']:,}", f"{s['bytes_needed']:,}", str(s["step"]))
    console.print(table)
    read = sum(s["bytes_read"] for s in stats)
    console.print(f"saved {sizes[0]:,} bytes by {md.world_size} ranks in {t_save:.2f}s; "
                  f"resharded load in {t_load:.2f}s; read amplification {read / md.total_bytes:.2f}")

    # resume: load the checkpoint into a fresh model + optimizer, train on, compare with the reference
    model2 = make_model()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    train(model2, opt2, 1, start=100)  # different state, so the load has something to overwrite
    state = {"model": model2.state_dict(), "step": 0}
    names = {id(p): n for n, p in model2.named_parameters()}
    state["optim"] = {names[id(p)]: {k: s[k] for k in ("exp_avg", "exp_avg_sq")} for p, s in opt2.state.items()}
    raydcp.load(state, path, strict=False)
    for p, s in opt2.state.items():
        s["step"] = torch.tensor(float(state["step"]))
    ref_loss = train(model, opt, 3, start=5)
    resumed_loss = train(model2, opt2, 3, start=5)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    console.print(f"resumed training: loss {resumed_loss:.6f} vs uninterrupted {ref_loss:.6f}; "
                  f"parameters {'identical' if same else 'DIFFERENT'}")
    if bad or not same or read > md.total_bytes:
        console.print(f"[red]FAILED[/]: mismatched keys {bad}")
        return 1
    console.print("[green]OK[/]: every value verified")
    return 0


if __name__ == "__main__":
    sys.exit(main())
