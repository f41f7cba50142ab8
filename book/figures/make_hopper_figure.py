"""Draws book/figures/hopper_program.png: one program of the fused mixing stack on
one Hopper SM, with the four things chapter 6's kernel listings use (Gluon's
explicit shared memory, TMA, mbarriers, wgmma).

Run from the repository root: ``python book/figures/make_hopper_figure.py``.

The book shows the figure at its content width, about 770 px on a 1400 px window, so
the 7-inch figure (1540 px) is shown at half its size: 1 pt of font is about 1.5 px on
screen. The smallest text is 9 pt, about 14 px there.

The sizes are the fused stack's (``ecekern/stack_fused``): a tile of 32 edges, cos
over sin, is 64 rows a order; the state u is 3 orders x 64 rows x 192 features in
fp32 (144 KiB); the weights' ring holds 3 stages of three ``[64, 32]`` fp32 boxes
(72 KiB); 227 KiB of shared memory is what one program may take on an H100/H200.
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import Circle, FancyArrowPatch, FancyBboxPatch

WIDTH, HEIGHT, DPI = 7.0, 4.3, 220  # inches; 1540 x 946 px
TITLE, BODY = 10.5, 9  # pt
GLOBAL, SHARED, REGS, RING = "#dfe7f2", "#e3f1de", "#fde8cf", "#c9e3c0"
EDGE, INK, ARROW = "#555555", "#222222", "#8a3b12"


def box(ax, x, y, w, h, color, lw=0.9):
    ax.add_patch(
        FancyBboxPatch(
            (x, y), w, h, boxstyle="round,pad=0.03", fc=color, ec=EDGE, lw=lw
        )
    )


def text(ax, x, y, s, size=BODY, **kw):
    kw.setdefault("ha", "center")
    kw.setdefault("va", "center")
    kw.setdefault("color", INK)
    ax.text(x, y, s, fontsize=size, linespacing=1.2, **kw)


def arrow(ax, a, b, label=None, at=None, rad=0.0, **kw):
    ax.add_patch(
        FancyArrowPatch(
            a,
            b,
            arrowstyle="-|>",
            mutation_scale=11,
            lw=1.4,
            color=ARROW,
            connectionstyle=f"arc3,rad={rad}",
        )
    )
    if label:
        text(ax, *at, label, color=ARROW, **kw)


def main(path: Path) -> None:
    fig, ax = plt.subplots(figsize=(WIDTH, HEIGHT), dpi=DPI)
    ax.set_xlim(0, 14)
    ax.set_ylim(0.4, 9.2)
    ax.axis("off")

    # global memory: HBM, with L2 in front of it
    box(ax, 0.1, 1.9, 2.8, 7.1, GLOBAL)
    text(ax, 1.5, 8.55, "HBM + L2", TITLE, weight="bold")
    text(ax, 1.5, 7.55, "x rows\n(planes, in)")
    text(ax, 1.5, 5.6, "z, y rows\n(planes, out)")
    text(ax, 1.5, 3.6, "W of every\nlayer: 1.1 MB,\nhot in L2")

    # shared memory of one program
    box(ax, 3.9, 1.9, 5.0, 7.1, SHARED)
    text(ax, 6.4, 8.55, "shared memory", TITLE, weight="bold")
    box(ax, 4.15, 6.3, 4.5, 1.75, "#f6fbf4")
    text(ax, 6.4, 7.35, "u: the tile's state, in place\n3 orders x 64 rows x 192, fp32")
    text(ax, 6.4, 6.65, "144 KiB", weight="bold")
    for s in range(3):
        x0 = 4.15 + 1.55 * s
        box(ax, x0, 2.75, 1.4, 2.3, RING)
        text(ax, x0 + 0.7, 4.6, f"stage {s}")
        text(ax, x0 + 0.7, 3.85, "3 boxes\n64 x 32")
        ax.add_patch(Circle((x0 + 0.7, 3.1), 0.2, fc="white", ec=ARROW, lw=1.3))
    text(ax, 6.4, 2.3, "W ring: 72 KiB; o = its mbarrier", weight="bold")

    # registers of the two warpgroups
    box(ax, 10.6, 3.6, 3.3, 5.4, REGS)
    text(ax, 12.25, 8.55, "registers", TITLE, weight="bold")
    text(ax, 12.25, 7.75, "2 warpgroups\n(8 warps)")
    box(ax, 10.8, 5.4, 2.9, 1.6, "#fff6ea")
    text(ax, 12.25, 6.2, "accumulators\n3 x [64 x 64] fp32")
    text(ax, 12.25, 4.45, "wgmma: A (u)\nfrom registers,\nB (W) from shared")

    # the data movement
    arrow(ax, (2.9, 3.6), (4.15, 3.9), "TMA", (3.4, 4.2), weight="bold")
    arrow(ax, (2.9, 7.55), (4.15, 7.4), "load", (3.4, 7.85))
    arrow(ax, (8.65, 7.6), (10.8, 6.85), "K step of u", (9.75, 7.85))
    arrow(ax, (8.65, 4.0), (10.8, 5.5), "W box", (9.55, 4.25))
    arrow(ax, (10.8, 6.2), (8.65, 6.75), None)
    text(ax, 9.75, 6.2, "epilogue", color=ARROW)
    arrow(ax, (10.8, 5.7), (2.9, 5.6), None)
    text(ax, 6.4, 5.85, "z, y stores", color=ARROW)

    # one K step, in order
    steps = (
        "one K step:  1 wait on the stage's mbarrier   2 issue the wgmma (async)   "
        "3 wait for the step\nbefore's wgmma   4 barrier   5 TMA the weights for "
        "two steps ahead into the stage it freed"
    )
    text(ax, 7.0, 0.85, steps, ha="center")

    fig.tight_layout(pad=0.2)
    fig.savefig(path, dpi=DPI)


if __name__ == "__main__":
    main(Path(__file__).with_name("hopper_program.png"))
