"""Draws book/figures/edge_layer_program.png: one program of chapter 8's fused edge
layer on one tile of edges: its four phases, the scratch they pass the tile through,
and the reduction into dst with the tile's two boundary partials.

Run from the repository root: ``python book/figures/make_edge_layer_figure.py``.

The sizes are read from the library (``ecekern.edge_layer.BLOCK_E``, the book's
``ECEConfig``), not typed: a tile of ``BLOCK_E`` edges, the scratch ``(n_ang, 2,
BLOCK_E, F)`` twice and ``(n_ang, 2, BLOCK_E, F')`` once, in fp32. As the other
figures: 7 inches at 220 dpi, shown at about half size on a 1400 px window; the
smallest text is 9 pt.
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

from ecekern import ECEConfig
from ecekern.edge_layer import BLOCK_E

WIDTH, HEIGHT, DPI = 7.0, 4.6, 220  # inches
TITLE, BODY = 10.5, 9  # pt
GLOBAL, PROG, SCRATCH, PHASE = "#dfe7f2", "#e3f1de", "#fde8cf", "#f6fbf4"
EDGE, INK, ARROW = "#555555", "#222222", "#8a3b12"
SEGMENTS = ("#b3cde3", "#ccebc5", "#decbe4", "#fed9a6", "#fbb4ae")


def box(ax, x, y, w, h, color, lw=0.9, ls="-"):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.03", fc=color,
                                ec=EDGE, lw=lw, ls=ls))  # fmt: skip


def text(ax, x, y, s, size=BODY, **kw):
    kw.setdefault("ha", "center")
    kw.setdefault("va", "center")
    kw.setdefault("color", INK)
    ax.text(x, y, s, fontsize=size, linespacing=1.2, **kw)


def arrow(ax, a, b, rad=0.0):
    style = f"arc3,rad={rad}"
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=10, lw=1.2,
                                 color=ARROW, connectionstyle=style))  # fmt: skip


def main(path: Path) -> None:
    cfg = ECEConfig()
    F, FO, NA, K = cfg.F, cfg.channels * (cfg.lmax + 1), cfg.n_ang, cfg.n_gated
    kib = lambda n: n * 4 / 1024  # noqa: E731  fp32 values -> KiB
    x_kib, y_kib = kib(NA * 2 * BLOCK_E * F), kib(NA * 2 * BLOCK_E * FO)

    fig, ax = plt.subplots(figsize=(WIDTH, HEIGHT), dpi=DPI)
    ax.set_xlim(0, 14)
    ax.set_ylim(-0.2, 9.4)
    ax.axis("off")

    # global memory: what a tile reads and writes
    box(ax, 0.1, 0.2, 2.7, 8.8, GLOBAL)
    text(ax, 1.45, 8.6, "HBM + L2", TITLE, weight="bold")
    text(ax, 1.45, 7.5, f"per edge:\nP ({2 * cfg.S * NA}), rho ({F}),\nenv, src, dst")
    text(ax, 1.45, 5.9, "h rows\n(gathered,\nL2-resident)")
    text(ax, 1.45, 4.3, "W of the\nstack (L2)")
    text(ax, 1.45, 2.6, "Delta (N, S, C)", weight="bold")
    text(ax, 1.45, 1.2, "partials\n(n_tiles, 2, S, C)")

    # one program: four phases, a barrier after each
    box(ax, 3.25, 0.2, 4.75, 8.8, PROG)
    text(ax, 5.6, 8.6, f"one program: {BLOCK_E} edges", TITLE, weight="bold")
    phases = (
        "1  rotate: A = [h[dst] | h[src]]\n   x = rho * (P blocks) A",
        f"2  {K} gated layers, order by\n   order (m = 0 first: the gate)",
        "3  output layer: y",
        "4  unrotate, x env; one-hot\n   segment sums (dst)",
    )
    ys = (7.3, 5.5, 3.85, 2.05)
    for y, s in zip(ys, phases):
        box(ax, 3.45, y - 0.6, 4.35, 1.2, PHASE)
        text(ax, 3.6, y, s, ha="left")
    for y in (6.45, 4.65, 3.0):
        ax.plot([3.45, 7.8], [y, y], ls=(0, (4, 3)), color=EDGE, lw=0.8)
    note = "- - -  barrier: the next phase reads\nwhat other threads wrote"
    text(ax, 5.6, 0.85, note, color=EDGE)

    # the program's scratch (its own slice, in L2)
    box(ax, 8.35, 3.1, 2.3, 5.9, SCRATCH, ls="--")
    text(ax, 9.5, 8.6, "scratch", TITLE, weight="bold")
    text(ax, 9.5, 7.75, f"u0: x, then u\n{x_kib:.0f} KiB")
    text(ax, 9.5, 6.0, f"u1: u\n{x_kib:.0f} KiB")
    text(ax, 9.5, 4.2, f"y\n{y_kib:.0f} KiB")
    arrow(ax, (7.8, 7.3), (8.6, 7.6))
    arrow(ax, (8.6, 6.3), (7.8, 5.7), rad=0.2)
    arrow(ax, (7.8, 5.3), (8.6, 5.8), rad=0.2)
    arrow(ax, (7.8, 3.85), (8.6, 4.1))
    arrow(ax, (8.6, 3.8), (7.8, 2.3))

    # inputs and outputs
    arrow(ax, (2.8, 7.4), (3.45, 7.3))
    arrow(ax, (2.8, 5.9), (3.45, 7.0))
    arrow(ax, (2.8, 4.3), (3.45, 5.3))
    arrow(ax, (3.45, 2.0), (2.8, 2.55))
    arrow(ax, (3.45, 1.75), (2.8, 1.3))

    # the tile's dst segments
    x0, w = 11.0, 2.9
    text(ax, x0 + w / 2, 8.6, "the tile's dst", TITLE, weight="bold")
    runs = (3, 4, 2, 5, 2)  # illustrative segment lengths, BLOCK_E = 16 in all
    y, cell = 8.0, 7.0 / sum(runs)
    for i, n in enumerate(runs):
        ax.add_patch(Rectangle((x0, y - n * cell), 0.45, n * cell, fc=SEGMENTS[i],
                               ec=EDGE, lw=0.7))  # fmt: skip
        label = ("first: partial ->\npart[tile, 0]" if i == 0 else
                 "last: partial ->\npart[tile, 1]" if i == len(runs) - 1 else
                 "inner: whole ->\nDelta[n]")  # fmt: skip
        text(ax, x0 + 0.6, y - n * cell / 2, label, ha="left")
        y -= n * cell
    text(ax, x0 + w / 2, 0.35, "a second kernel adds each\nnode's partials in tile "
         "order", color=EDGE)  # fmt: skip

    fig.tight_layout(pad=0.2)
    fig.savefig(path, dpi=DPI)


if __name__ == "__main__":
    main(Path(__file__).with_name("edge_layer_program.png"))
