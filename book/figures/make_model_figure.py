"""Draws book/figures/model.png, the model in one picture (README and intro).

Run from the repository root: ``python book/figures/make_model_figure.py``.
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

STAGES = [
    ("graph", "neighbours\nsorted by dst\nCSR row_ptr", "#dfe7f2"),
    ("geometry", "r_e, |r_e|\nBessel basis\nradial MLP", "#dfe7f2"),
    ("edge\nframes", "D_e = D(R_e)\nR_e u_e = z\n(E, S, S)", "#fde8cf"),
    ("GIE", "zonal\nscatter\nh0 (N, S, C)", "#fde8cf"),
    ("rotate &\nselect", "D_e @ A_e\ncos, sin\n(E, F, n_ang)", "#e3f1de"),
    ("mixing\nstack", "K x Equi-\nvariantLinear\n+ gate", "#e3f1de"),
    ("pack &\nunrotate", "D_e^T\nmsg\n(E, S, C)", "#e3f1de"),
    ("aggregate\n+ update", "k sum\nu_e msg_e\nNodeLinear\nh += ...", "#e3f1de"),
    ("readout", "MLP(h[:,0])\nE = sum\nF = -dE/dx", "#ece3f4"),
]
CHAPTER = {
    "rotate &\nselect": "planned",
    "mixing\nstack": "ch 2",
    "pack &\nunrotate": "planned",
    "GIE": "ch 5",
}


def main(path="book/figures/model.png"):
    fig, ax = plt.subplots(figsize=(12, 3.6))
    ax.set_xlim(0, len(STAGES) * 1.2)
    ax.set_ylim(-0.7, 2.3)
    ax.axis("off")
    for i, (name, body, color) in enumerate(STAGES):
        x = i * 1.2 + 0.05
        ax.add_patch(
            FancyBboxPatch(
                (x, 0.25),
                1.0,
                1.55,
                boxstyle="round,pad=0.03",
                fc=color,
                ec="#555555",
                lw=0.8,
            )
        )
        ax.text(
            x + 0.5, 1.5, name, ha="center", va="center", fontsize=8.5, weight="bold"
        )
        ax.text(
            x + 0.5,
            0.72,
            body,
            ha="center",
            va="center",
            fontsize=7,
            family="monospace",
        )
        if name in CHAPTER:
            ax.text(
                x + 0.5,
                0.05,
                CHAPTER[name],
                ha="center",
                va="center",
                fontsize=8,
                color="#b3541e",
            )
        if i:
            ax.add_patch(
                FancyArrowPatch(
                    (x - 0.17, 0.9),
                    (x - 0.02, 0.9),
                    arrowstyle="-|>",
                    mutation_scale=10,
                    color="#555555",
                )
            )
    x0, x1 = 4 * 1.2 + 0.05, 7 * 1.2 + 1.05
    ax.annotate(
        "",
        xy=(x0 + 0.3, 1.85),
        xytext=(x1 - 0.3, 1.85),
        arrowprops=dict(
            arrowstyle="-|>", color="#2f6f3e", connectionstyle="arc3,rad=0.25"
        ),
    )
    ax.text(
        (x0 + x1) / 2,
        2.2,
        "interaction layer, repeated (default 2)",
        ha="center",
        fontsize=8.5,
        color="#2f6f3e",
    )
    ax.text(
        0.05,
        -0.45,
        "per edge, in its own frame: SO(2) convolutions; per node: "
        "(N, S, C) features, S = (L+1)^2",
        fontsize=8,
        color="#444444",
    )
    fig.savefig(Path(path), bbox_inches="tight", dpi=130, metadata={"Software": None})


if __name__ == "__main__":
    main()
