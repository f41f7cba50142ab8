"""Draws book/figures/model.png, the model in one picture (README and intro).

Run from the repository root: ``python book/figures/make_model_figure.py``.

The book shows the figure at its content width, about 760 px on a 1400 px window,
so the 8-inch figure is shown at about half its 1600 px: 1 pt of font is about
1.3 px on screen. The smallest text is 10.5 pt, about 14 px there.
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

WIDTH, HEIGHT, DPI = 8.0, 4.8, 200  # inches; 1600 x 960 px
TITLE, BODY = 12, 10.5  # pt
BLUE, ORANGE, GREEN, PURPLE = "#dfe7f2", "#fde8cf", "#e3f1de", "#ece3f4"
EDGE, INK, CH, PLANNED = "#555555", "#222222", "#b3541e", "#777777"

# (title, body, colour, chapter tag); a tag is the chapter that makes the stage a
# kernel, or "planned". Chapter 1 writes every stage in plain PyTorch.
ONCE = [
    ("graph", "neighbour list,\nedges sorted by dst", BLUE, "ch 4"),
    ("geometry", "edge vectors r_e,\nradial basis + MLP", BLUE, "ch 7"),
    ("edge frames", "rotations D_e that\nturn each edge to z", ORANGE, "ch 7"),
    ("initial embedding", "zonal scatter\ninto h0 (N, S, C)", ORANGE, "ch 5"),
]
LAYER = [
    ("rotate &\nselect", "features into\nthe edge frame", GREEN, "ch 3"),
    ("mixing\nstack", "gated\nEquivariantLinear", GREEN, "ch 2, 6"),
    ("pack &\nunrotate", "back to the\nglobal frame", GREEN, "ch 3"),
    ("aggregate\n& update", "sum over\nneighbours", GREEN, "ch 3"),
]
READOUT = ("readout", "MLP gives E;\nF = -dE/dx", PURPLE, None)


def box(ax, x, y, w, h, title, body, color, tag):
    ax.add_patch(
        FancyBboxPatch(
            (x, y), w, h, boxstyle="round,pad=0.02", fc=color, ec=EDGE, lw=0.9
        )
    )
    top = y + h - 0.1
    ax.text(x + w / 2, top, title, ha="center", va="top", fontsize=TITLE, weight="bold")
    n_title = title.count("\n") + 1
    body_top = top - 0.22 * n_title - 0.08
    ax.text(
        x + w / 2,
        body_top,
        body,
        ha="center",
        va="top",
        fontsize=BODY,
        color=INK,
        linespacing=1.25,
    )
    if tag:
        ax.text(
            x + w / 2,
            y + 0.1,
            tag,
            ha="center",
            va="bottom",
            fontsize=BODY + 0.5,
            color=CH if tag.startswith("ch") else PLANNED,
            weight="bold",
        )


def arrow(ax, a, b, color=EDGE, **kw):
    ax.add_patch(
        FancyArrowPatch(
            a, b, arrowstyle="-|>", mutation_scale=11, color=color, lw=1.1, **kw
        )
    )


def main(path="book/figures/model.png"):
    fig = plt.figure(figsize=(WIDTH, HEIGHT))
    ax = fig.add_axes([0, 0, 1, 1])
    ax.set_xlim(0, WIDTH)
    ax.set_ylim(0, HEIGHT)
    ax.axis("off")

    # row 1: once per step
    y1, h1, w1, gap1, x1 = 3.25, 1.2, 1.82, 0.17, 0.16
    ax.text(x1, y1 + h1 + 0.1, "once per step", fontsize=BODY, color=INK)
    for i, stage in enumerate(ONCE):
        x = x1 + i * (w1 + gap1)
        box(ax, x, y1, w1, h1, *stage)
        if i:
            arrow(ax, (x - gap1 + 0.02, y1 + h1 / 2), (x - 0.03, y1 + h1 / 2))

    # row 2: the interaction layer, then the readout
    y2, h2, w2, gap2, x2 = 0.66, 1.62, 1.38, 0.16, 0.3
    band = (x2 - 0.14, y2 - 0.12, 4 * w2 + 3 * gap2 + 0.28, h2 + 0.8)
    ax.add_patch(
        FancyBboxPatch(
            band[:2],
            *band[2:],
            boxstyle="round,pad=0.02",
            fc="#f4faf2",
            ec="#2f6f3e",
            lw=1.0,
            ls="--",
        )
    )
    for i, stage in enumerate(LAYER):
        x = x2 + i * (w2 + gap2)
        box(ax, x, y2, w2, h2, *stage)
        if i:
            arrow(ax, (x - gap2 + 0.02, y2 + h2 / 2), (x - 0.03, y2 + h2 / 2))
    x_ro = band[0] + band[2] + 0.22
    box(ax, x_ro, y2, WIDTH - 0.12 - x_ro, h2, *READOUT)
    x_last = x2 + 3 * (w2 + gap2) + w2
    arrow(ax, (x_last + 0.02, y2 + h2 / 2), (x_ro - 0.03, y2 + h2 / 2))

    # the layer repeats: from aggregate back to rotate, above the boxes
    y_loop = y2 + h2 + 0.2
    c_first, c_last = x2 + w2 / 2, x2 + 3 * (w2 + gap2) + w2 / 2
    ax.plot(
        [c_last, c_last, c_first], [y2 + h2 + 0.03, y_loop, y_loop], color="#2f6f3e"
    )
    arrow(ax, (c_first, y_loop), (c_first, y2 + h2 + 0.03), color="#2f6f3e")
    ax.text(
        (c_first + c_last) / 2,
        y_loop + 0.07,
        "interaction layer, repeated (2 by default)",
        ha="center",
        va="bottom",
        fontsize=BODY + 0.5,
        color="#2f6f3e",
    )

    # from the embedding (end of row 1) to the first layer (start of row 2)
    x_gie = x1 + 3 * (w1 + gap1) + w1 / 2
    y_mid = (y1 + band[1] + band[3]) / 2
    ax.plot(
        [x_gie, x_gie, 0.06, 0.06], [y1 - 0.03, y_mid, y_mid, y2 + h2 / 2], color=EDGE
    )
    arrow(ax, (0.06, y2 + h2 / 2), (x2 - 0.03, y2 + h2 / 2))
    ax.text(x_gie + 0.08, (y1 + y_mid) / 2, "h0", fontsize=BODY, va="center")

    ax.text(
        0.16,
        0.14,
        "Chapter 1: all in PyTorch.  ch 2, 3, 5, 7: a kernel there.  "
        "ch 4: a fixed edge capacity.  ch 6: edge cohorts.",
        fontsize=BODY,
        color=INK,
        va="bottom",
    )
    fig.savefig(Path(path), dpi=DPI, metadata={"Software": None})


if __name__ == "__main__":
    main()
