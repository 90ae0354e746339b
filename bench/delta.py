"""Delta checkpoints (SaveOptions(base="previous")) against full saves of the same state, same run.

Two states, each saved as a run of checkpoints, step after step, on the same disk:

  LoRA-like   a frozen base (--base-mib of float32 weights) plus adapters (--adapter-mib) and their
              AdamW state (exp_avg, exp_avg_sq: twice the adapters' bytes); between checkpoints the
              adapters and their state change, the base does not. --checkpoints checkpoints.
  dense       --dense-mib of float32 weights and their AdamW state, all of it changed between
              checkpoints (pre-training): what hashing costs where nothing can be reused.

At every step the same state is saved twice, in turns (the order alternates): as a delta of the
run's previous checkpoint (kept, under one root, as a training run keeps them) and as a full save
(raydcp.save without a base, into a new directory: two take turns, the older removed untimed first);
torch DCP's save (dcp.save) of the same state follows, for the peer's figure. Every file is
fsynced by the saves themselves. The deltas skip hashing what the kernel's write tracking says
nobody wrote since (docs/delta.md); RAYDCP_WRITE_TRACKING=0 in the environment hashes every byte. Reported, for checkpoints 2..N: the bytes each delta wrote (every
file of its directory: data, digest files, metadata and commit log) over the bytes that changed;
the medians of the save times and their ratio; the bytes the N kept delta checkpoints hold on disk
over one full checkpoint plus the changed bytes of the N-1 later ones. Then a load of the last
delta (references one hop into the first checkpoint, N-1 deltas deep) against a load of the
full checkpoint of the same state, alternating, medians of --repeats (the files are in the page
cache for both: the load measures raydcp's read path, not the disk). Every load is checked.

    python bench/delta.py                                    # 1 GiB base, 10 checkpoints; ~2 minutes
    python bench/delta.py --base-mib 128 --dense-mib 64 --checkpoints 4 --repeats 2   # quick
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import LoadRange, argv_line, goal, log, machine, median, save_json, table, timed  # noqa: E402

import raydcp  # noqa: E402
from raydcp import SaveOptions  # noqa: E402

MIB = 1 << 20


def lora_state(base_mib: int, adapter_mib: int) -> dict:
    g = torch.Generator().manual_seed(0)
    layers = 8
    base = {f"layers.{i}.w": torch.randn(base_mib * MIB // 4 // layers, generator=g) for i in range(layers)}
    ad = {f"layers.{i}.lora_{ab}": torch.randn(adapter_mib * MIB // 4 // (2 * layers), generator=g)
          for i in range(layers) for ab in "ab"}
    optim = {f"{k}.{m}": torch.zeros_like(v) for k, v in ad.items() for m in ("exp_avg", "exp_avg_sq")}
    return {"base": base, "adapters": ad, "optim": optim, "step": 0}


def dense_state(mib: int) -> dict:
    g = torch.Generator().manual_seed(1)
    layers = 8
    w = {f"layers.{i}.w": torch.randn(mib * MIB // 4 // layers, generator=g) for i in range(layers)}
    optim = {f"{k}.{m}": torch.zeros_like(v) for k, v in w.items() for m in ("exp_avg", "exp_avg_sq")}
    return {"weights": w, "optim": optim, "step": 0}


def train_step(state: dict, trained: tuple[str, ...]) -> int:
    """Change every tensor of the ``trained`` groups in place; returns the bytes changed."""
    changed = 0
    for group in trained:
        for t in state[group].values():
            t.add_(1e-3)
            changed += t.nbytes
    state["step"] += 1
    return changed


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def same(a: dict, b: dict) -> bool:
    return all(same(a[k], b[k]) if isinstance(a[k], dict) else
               (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]) for k in a)


def blank(state: dict) -> dict:
    return {k: blank(v) if isinstance(v, dict) else (torch.empty_like(v) if isinstance(v, torch.Tensor) else None)
            for k, v in state.items()}


def run_series(name: str, state: dict, trained: tuple[str, ...], steps: int, root: str, loads: LoadRange,
               dcp: bool) -> dict:
    deltas, fulls, dcps, written, changed = [], [], [], [], []
    total = sum(t.nbytes for g in state.values() if isinstance(g, dict) for t in g.values())
    for step in range(1, steps + 1):
        ch = train_step(state, trained) if step > 1 else 0
        path = f"{root}/delta/step-{step}"

        def delta():
            return raydcp.save(state, path, options=SaveOptions(base="previous"))

        full_path = f"{root}/full-{step % 2}"
        shutil.rmtree(full_path, ignore_errors=True)  # untimed: the full save writes a new directory, as the delta

        def full():
            return raydcp.save(state, full_path)

        order = (delta, full) if step % 2 else (full, delta)
        times = {}
        for fn in order:
            times[fn.__name__], _ = timed(fn)
        if dcp:
            import torch.distributed.checkpoint as dcp_mod

            shutil.rmtree(f"{root}/dcp", ignore_errors=True)
            t, _ = timed(lambda: dcp_mod.save(state, checkpoint_id=f"{root}/dcp", no_dist=True))
            dcps.append(t)
        loads.sample()
        if step > 1:
            deltas.append(times["delta"])
            fulls.append(times["full"])
            written.append(dir_bytes(path))
            changed.append(ch)
        log(f"{name} step {step}: delta {times['delta']:.3f} s, full {times['full']:.3f} s, "
            f"delta wrote {dir_bytes(path) / MIB:.1f} MiB of {total / MIB:.0f} MiB ({ch / MIB:.1f} MiB changed)")
    held = dir_bytes(f"{root}/delta")
    one_full = dir_bytes(f"{root}/full-{steps % 2}")
    return {"state_mib": total / MIB, "delta_s": median(deltas), "full_s": median(fulls),
            "dcp_s": median(dcps) if dcps else None, "written_over_changed": sum(written) / max(sum(changed), 1),
            "written_mib": sum(written) / MIB, "changed_mib": sum(changed) / MIB,
            "held_over_full_plus_history": held / (one_full + sum(changed)),
            "held_mib": held / MIB, "full_mib": one_full / MIB}


def load_pair(state: dict, root: str, steps: int, repeats: int) -> dict:
    last, full = f"{root}/delta/step-{steps}", f"{root}/full-{steps % 2}"
    out = blank(state)
    for warm in (full, last):  # untimed: fresh tensors' page faults, and every file read once (page cache)
        raydcp.load(out, warm)
    td, tf = [], []
    for r in range(repeats):
        for which in ((last, full) if r % 2 == 0 else (full, last)):
            t, _ = timed(lambda: raydcp.load(out, which))
            assert same(out, state), f"{which} did not load the saved state"
            (td if which == last else tf).append(t)
    md = raydcp.read_metadata(last)
    return {"delta_load_s": median(td), "full_load_s": median(tf), "references": md.references,
            "owned_mib": md.owned_bytes / MIB}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-mib", type=int, default=1024)
    ap.add_argument("--adapter-mib", type=int, default=16)
    ap.add_argument("--dense-mib", type=int, default=256)
    ap.add_argument("--checkpoints", type=int, default=10)
    ap.add_argument("--dense-checkpoints", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory on the disk of /tmp)")
    ap.add_argument("--no-dcp", action="store_true", help="skip torch DCP's save (the peer's figure)")
    args = ap.parse_args()
    loads = LoadRange()
    root = tempfile.mkdtemp(prefix="raydcp-delta-", dir=args.dir)
    try:
        log(f"LoRA-like: {args.base_mib} MiB frozen, {args.adapter_mib} MiB adapters + AdamW state, "
            f"{args.checkpoints} checkpoints")
        lora = lora_state(args.base_mib, args.adapter_mib)
        lo = run_series("lora", lora, ("adapters", "optim"), args.checkpoints, f"{root}/lora", loads, not args.no_dcp)
        lo.update(load_pair(lora, f"{root}/lora", args.checkpoints, args.repeats))
        shutil.rmtree(f"{root}/lora")
        del lora
        log(f"dense: {args.dense_mib} MiB weights + AdamW state, all changed, {args.dense_checkpoints} checkpoints")
        dense = dense_state(args.dense_mib)
        de = run_series("dense", dense, ("weights", "optim"), args.dense_checkpoints, f"{root}/dense", loads,
                        not args.no_dcp)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    goals = [
        ("LoRA: bytes written by checkpoints 2..N / bytes changed", lo["written_over_changed"], "<= 1.1",
         lo["written_over_changed"] <= 1.1),
        ("LoRA: full save time / delta save time", lo["full_s"] / lo["delta_s"], ">= 10",
         lo["full_s"] / lo["delta_s"] >= 10),
        ("LoRA: disk held by N deltas / (one full + changed bytes)", lo["held_over_full_plus_history"], "<= 1.2",
         lo["held_over_full_plus_history"] <= 1.2),
        ("dense: delta save time / full save time", de["delta_s"] / de["full_s"], "<= 1.1",
         de["delta_s"] / de["full_s"] <= 1.1),
        ("LoRA: load of the last delta / load of a full checkpoint", lo["delta_load_s"] / lo["full_load_s"],
         "<= 1.1", lo["delta_load_s"] / lo["full_load_s"] <= 1.1),
    ]
    rows = [[n, v, want, goal(ok)] for n, v, want, ok in goals]
    print()
    print(table(["ratio", "measured", "goal", ""], rows))
    print()
    print(table(["state", "MiB", "delta save s", "full save s", "torch DCP save s", "written MiB (2..N)",
                 "changed MiB (2..N)", "held MiB", "one full MiB"],
                [["LoRA-like", lo["state_mib"], lo["delta_s"], lo["full_s"], lo["dcp_s"], lo["written_mib"],
                  lo["changed_mib"], lo["held_mib"], lo["full_mib"]],
                 ["dense", de["state_mib"], de["delta_s"], de["full_s"], de["dcp_s"], de["written_mib"],
                  de["changed_mib"], None, de["full_mib"]]]))
    print(f"\nload: last delta {lo['delta_load_s']:.3f} s (owns {lo['owned_mib']:.1f} MiB, references "
          f"{', '.join(lo['references'])}), full {lo['full_load_s']:.3f} s; load average {loads}")
    print(f"command: {argv_line()}")
    save_json("delta", {"machine": machine(), "args": vars(args), "lora": lo, "dense": de,
                        "goals": [{"name": n, "value": v, "goal": w, "met": ok} for n, v, w, ok in goals]})


if __name__ == "__main__":
    main()
