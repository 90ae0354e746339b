"""Compressed checkpoints: bytes saved and save / load throughput against uncompressed, same data.

The data: a small GPT-style transformer (token and position embeddings, pre-norm encoder layers
with 8 heads and a 4x MLP, final LayerNorm, an untied LM head), initialised with PyTorch's
defaults and trained a few AdamW steps (lr 1e-3, weight decay 0.1) on synthetic token sequences
drawn from a random order-1 Markov chain, on CPU. Three checkpoints of it:

  bf16 weights   the parameters cast to bfloat16 (what an inference export holds)
  fp32 weights   the parameters in float32 (what a training checkpoint holds)
  AdamW state    the optimizer's exp_avg and exp_avg_sq (float32) and step counts

Each is saved with ``raydcp.save(..., options=SaveOptions(compression=...))`` for None, "zstd"
and "lz4" (pyarrow's codecs at their default levels), every file fsynced, and loaded back into
preallocated tensors (the files are in the page cache: the load measures reading and
decompressing, not the disk). The codecs take turns within each repeat (the order rotates);
medians of --repeats. Stored/raw is the stored bytes over the raw tensor bytes; MB/s counts raw
bytes (what the caller saves or gets back), so a codec is worth its CPU where the storage, not the
CPU, is the limit. Every load is compared with the saved tensors.

    python bench/compression.py                            # 13M parameters; a few minutes on 2 cores
    python bench/compression.py --dim 128 --layers 1 --steps 2 --repeats 1   # quick
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import LoadRange, argv_line, log, machine, median, save_json, table, timed  # noqa: E402

import raydcp  # noqa: E402
from raydcp.options import SaveOptions  # noqa: E402

CODECS = (None, "zstd", "lz4")
MB = 1e6


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, seq: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        layer = nn.TransformerEncoderLayer(dim, 8, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos(torch.arange(x.shape[1]))
        h = self.blocks(h, mask=self.mask[:x.shape[1], :x.shape[1]], is_causal=True)
        return self.head(self.norm(h))


def trained(args) -> tuple[nn.Module, torch.optim.Optimizer, list[float]]:
    """The model after ``args.steps`` AdamW steps on Markov-chain token sequences; the losses."""
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = TinyGPT(args.vocab, args.dim, args.layers, args.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    # each token has 4 likely successors: a language the model can start to learn in a few steps
    succ = torch.randint(0, args.vocab, (args.vocab, 4), generator=g)
    losses = []
    for _ in range(args.steps):
        x = torch.empty(args.batch, args.seq + 1, dtype=torch.long)
        x[:, 0] = torch.randint(0, args.vocab, (args.batch,), generator=g)
        for t in range(args.seq):
            x[:, t + 1] = succ[x[:, t], torch.randint(0, 4, (args.batch,), generator=g)]
        logits = model(x[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, args.vocab), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(round(loss.item(), 3))
    return model, opt, losses


def datasets(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    params = dict(model.named_parameters())
    names = {id(p): n for n, p in params.items()}
    adam = {}
    for p, st in opt.state.items():
        for k, v in st.items():
            adam[f"{names[id(p)]}.{k}"] = v.detach().clone()
    return {
        "bf16 weights": {n: p.detach().to(torch.bfloat16) for n, p in params.items()},
        "fp32 weights": {n: p.detach().clone() for n, p in params.items()},
        "AdamW state": adam,
    }


def run(args) -> dict:
    load = LoadRange()
    log(f"training a {args.layers}-layer GPT-style model (dim {args.dim}, vocab {args.vocab}) for {args.steps} steps")
    model, opt, losses = trained(args)
    nparams = sum(p.numel() for p in model.parameters())
    log(f"{nparams / 1e6:.1f}M parameters; losses {losses}")
    root = Path(tempfile.mkdtemp(prefix="raydcp-compression-", dir=args.dir))
    results: dict = {}
    try:
        warm = {"w": torch.randn(1 << 16), "b": torch.zeros(1 << 16)}  # imports, codecs, threads: untimed
        for codec in CODECS:
            raydcp.save(warm, root / "warm", options=SaveOptions(compression=codec))
            raydcp.load({k: torch.empty_like(v) for k, v in warm.items()}, root / "warm")
        for name, sd in datasets(model, opt).items():
            raw = sum(t.numel() * t.element_size() for t in sd.values())
            times = {c: {"save": [], "load": []} for c in CODECS}
            stored = {}
            for rep in range(args.repeats):
                order = CODECS[rep % len(CODECS):] + CODECS[:rep % len(CODECS)]
                for codec in order:
                    path = root / f"{name.replace(' ', '-')}-{codec}"
                    shutil.rmtree(path, ignore_errors=True)
                    dt, md = timed(lambda: raydcp.save(sd, path, options=SaveOptions(compression=codec)))
                    times[codec]["save"].append(dt)
                    stored[codec] = md.stored_bytes
                    out = {k: torch.empty_like(v) for k, v in sd.items()}
                    dt, _ = timed(lambda: raydcp.load(out, path))
                    times[codec]["load"].append(dt)
                    bad = [k for k, v in sd.items() if not torch.equal(out[k], v)]
                    if bad:
                        raise SystemExit(f"{name} with {codec}: loaded values differ at {bad[:3]}")
                log(f"{name}: repeat {rep + 1}/{args.repeats} done (load average {load.sample()})")
            results[name] = {
                str(c): {"raw_bytes": raw, "stored_bytes": stored[c], "save_s": median(times[c]["save"]),
                         "load_s": median(times[c]["load"]), "save_all": times[c]["save"],
                         "load_all": times[c]["load"]} for c in CODECS}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"machine": machine(), "argv": argv_line(), "load_average": str(load), "parameters": nparams,
            "losses": losses, "results": results}


def report(data: dict) -> str:
    rows = []
    for name, by_codec in data["results"].items():
        base = by_codec["None"]
        for codec, r in by_codec.items():
            rows.append([name, codec if codec != "None" else "none", r["raw_bytes"] / MB, r["stored_bytes"] / MB,
                         f"{r['stored_bytes'] / r['raw_bytes']:.3f}", r["save_s"], r["raw_bytes"] / MB / r["save_s"],
                         f"{r['save_s'] / base['save_s']:.2f}x", r["load_s"], r["raw_bytes"] / MB / r["load_s"],
                         f"{r['load_s'] / base['load_s']:.2f}x"])
    return table(["checkpoint", "codec", "raw MB", "stored MB", "stored/raw", "save s", "save MB/s",
                  "save time vs none", "load s", "load MB/s", "load time vs none"], rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5, help="AdamW steps before the checkpoints are taken")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write the checkpoints (default: the temp dir)")
    args = ap.parse_args()
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    data = run(args)
    log(f"saved {save_json('compression', data)}")
    print(f"\n{data['parameters'] / 1e6:.1f}M parameters, losses {data['losses']}; load average {data['load_average']}\n")
    print(report(data))


if __name__ == "__main__":
    main()
