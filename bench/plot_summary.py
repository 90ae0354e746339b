"""Draw the summary table of BENCHMARKS.md (ratios against torch DCP) as docs/img/benchmarks.png.

The figures are the recorded runs that BENCHMARKS.md names; this script only reads the table that
follows the ``summary-table`` marker, so the plot and the table cannot disagree::

    .venv/bin/python bench/plot_summary.py            # writes docs/img/benchmarks.png
    .venv/bin/python bench/plot_summary.py --out x.png
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- summary-table"


def read_summary(text: str) -> list[tuple[str, float]]:
    """``(scenario, DCP / raydcp)`` for each row of the table after the marker."""
    lines = text.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith(MARKER))
    except StopIteration:
        raise SystemExit(f"BENCHMARKS.md has no line starting with {MARKER!r}") from None
    rows = []
    for line in lines[start + 1:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] in ("scenario", "") or set(cells[0]) <= set("-:"):
            continue
        rows.append((re.sub(r"`", "", cells[0]), float(cells[2])))
    if not rows:
        raise SystemExit("the summary table of BENCHMARKS.md has no rows")
    return rows


def plot(rows: list[tuple[str, float]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [re.split(r" vs | \(", name)[0] for name, _ in rows]
    ratios = [r for _, r in rows]
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(rows) + 1.2), dpi=120)
    bars = ax.barh(range(len(rows)), ratios, color="#3b7dd8")
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_yticks(range(len(rows)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("torch DCP time / raydcp time (log scale; > 1: raydcp faster)")
    ax.set_title("raydcp against torch.distributed.checkpoint (same data, same run)", fontsize=10)
    for bar, r in zip(bars, ratios):
        ax.text(bar.get_width() * 1.05, bar.get_y() + bar.get_height() / 2, f"{r:g}x", va="center")
    ax.set_xlim(0.5, max(ratios) * 3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    print(f"wrote {out} ({len(rows)} rows)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--benchmarks", type=Path, default=ROOT / "BENCHMARKS.md")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "benchmarks.png")
    args = ap.parse_args()
    plot(read_summary(args.benchmarks.read_text()), args.out)


if __name__ == "__main__":
    main()
