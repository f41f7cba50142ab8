# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 2. EquivariantLinear: one row-major GEMM
#
# *(Draft, not in the book's table of contents: it reads the chapter's capture,
# ``book/captures/02_block_diagonal_gemm``, which the next GPU session takes. Tried
# against the partial rows in ``02_block_diagonal_gemm_history``.)*
#
# Inside every interaction layer the model mixes channels with an *equivariant
# linear* map: each angular mode $m$ of the edge-frame features gets its own weight
# matrix, and the same matrix acts on the cos and the sin part of that mode. The
# reference writes it as an einsum. This chapter shows what the einsum costs in the
# force step, replaces it with one row-major GEMM against a block-diagonal weight,
# and measures a Triton kernel that skips the zero blocks. The module is
# `ecekern.linear`.

# %% tags=["remove-cell"]
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
import matplotlib.pyplot as plt
from IPython.display import Markdown, display
from matplotlib.patches import Rectangle

from ecekern import captures, linear, reference
from ecekern.testing import rel_err

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
cap = captures.load("02_block_diagonal_gemm")
sweep = cap.csv("linear_sweep")
launch = cap.csv("launch_sweep")
steps = cap.csv("model_steps")


def cell(path, dtype, E=47_000, n_ang=3):
    return next(
        r
        for r in sweep
        if (r["path"], r["dtype"], r["E"], r["n_ang"]) == (path, dtype, E, n_ang)
    )


def md(text):
    display(Markdown(text))


# %% [markdown]
# ## The operation
#
# Features in the edge frame come in pairs, `x_cos` and `x_sin`, each of shape
# `(..., K, n_ang)`: $K$ channels, and for each the angular modes $m = 0 \dots
# n_\text{ang} - 1$. A rotation about the edge axis by $\alpha$ turns each pair
# $(\cos, \sin)$ of mode $m$ by $m\alpha$. A linear map commutes with that rotation
# exactly when it never mixes modes and uses one matrix per mode for both parts:
#
# $$ y_{b o m} = \sum_i x_{b i m} W_{m o i} \;(+ \text{bias}_o \text{ at } m = 0
#    \text{ of cos}). $$
#
# Only the $m = 0$ cos slot is invariant, so only it takes a bias.
#
# ```{literalinclude} ../ecekern/reference.py
# :pyobject: equivariant_linear
# ```
#
# ## The problem
#
# `torch.einsum("...im,moi->...om")` lowers to a batched matmul over $m$, and a
# batched matmul wants each batch contiguous. Our layout is row-major with $m$
# fastest, so every call copies the activation into $m$-major order, multiplies, and
# returns an $m$-major result that the next consumer copies back. The force step's
# profile, with the einsum path and with the dense path of this chapter:

# %% tags=["remove-input"]
n_big = max(r["n_atoms"] for r in steps)
table = [r for r in steps if r["n_atoms"] == n_big and r["path"] in ("einsum", "dense")]
for r in table:
    r["precision"] = r["dtype"]
md(
    captures.markdown_table(
        table,
        {
            "path": "path",
            "precision": "precision",
            "step_ms": "force step (ms)",
            "calls_copy_": "aten::copy_ / step",
            "calls_bmm": "aten::bmm / step",
            "calls_addmm": "aten::addmm / step",
            "calls_mm": "aten::mm / step",
        },
        {"step_ms": "{:.2f}"},
    )
)

# %% [markdown]
# ## The idea
#
# The map never mixes modes, so it is a block-diagonal matrix acting on the
# flattened `(K n_ang)` row, exactly the row the activation already is in memory.
# Assemble the `(K n_ang, O n_ang)` weight from the parameter on every call (a few
# hundred kilobytes; autograd flows through the assembly) and the whole layer is one
# `addmm` on row-major data: no permute, no copy, the bias in the GEMM's epilogue.
# The price is the zero blocks: $n_\text{ang}$ times the flops the map needs.

# %% tags=["remove-input"]
fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6))
n, k = 3, 4
for m in range(n):
    for i in range(k):
        for o in range(k):
            a1.add_patch(
                Rectangle(
                    (o * n + m, i * n + m),
                    1,
                    1,
                    color=("#66c2a5", "#fc8d62", "#8da0cb")[m],
                )
            )
a1.set_xlim(0, k * n)
a1.set_ylim(k * n, 0)
a1.set_aspect("equal")
a1.set_xticks([])
a1.set_yticks([])
a1.set_title("dense weight (K n_ang, O n_ang): W[m] on\nevery m-th row and column")
for row_i, label in enumerate(("row-major (ours)", "m-major (what bmm wants)")):
    for j in range(12):
        m = j % n if row_i == 0 else j // k
        a2.add_patch(
            Rectangle(
                (j, 2 * row_i), 0.95, 0.9, color=("#66c2a5", "#fc8d62", "#8da0cb")[m]
            )
        )
    a2.text(0, 2 * row_i + 1.4, label, fontsize=9)
a2.set_xlim(0, 12)
a2.set_ylim(4, -0.5)
a2.axis("off")
a2.set_title("one edge's activation in memory, colour = mode m")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## The paths
#
# The dense path, all of it:
#
# ```{literalinclude} ../ecekern/linear.py
# :pyobject: _dense
# ```
#
# The Triton path would need neither the copies nor the zero blocks: one program
# loads a contiguous tile of rows, splits the modes on chip and runs one true dot per
# mode. The forward kernel the measurements below chose:
#
# ```{literalinclude} ../ecekern/linear.py
# :pyobject: _eqlin_fwd_bdot_kernel
# ```
#
# Which path runs is decided by measurement (the table at the end of this chapter):
#
# ```{literalinclude} ../ecekern/linear.py
# :pyobject: auto_path
# ```
#
# ## Is it right?
#
# Every path against the einsum in float64, with all gradients, on sizes that fit no
# block: (the Triton path runs in the CPU interpreter where there is no GPU.)

# %% tags=["nbval-check-output"]
g = torch.Generator().manual_seed(0)


def args(B, K, O, n_ang, dtype=torch.float64):
    xs = [torch.randn(B, K, n_ang, generator=g, dtype=dtype) for _ in range(2)]
    w = torch.randn(n_ang, O, K, generator=g, dtype=dtype) / K**0.5
    b = torch.randn(O, generator=g, dtype=dtype)
    return [t.to(DEV).requires_grad_() for t in (*xs, w, b)]


for B, K, O, n_ang in [(37, 19, 23, 2), (50, 33, 17, 3), (9, 5, 40, 5)]:
    a = args(B, K, O, n_ang)
    ref = reference.equivariant_linear(*a)
    gy = [torch.randn_like(t) for t in ref]
    want = list(ref) + list(torch.autograd.grad(ref, a, gy))
    worst = {}
    for path in ("dense", "triton"):
        got = linear.equivariant_linear(*a, path=path)
        got = list(got) + list(torch.autograd.grad(got, a, gy))
        worst[path] = max(rel_err(x, y) for x, y in zip(got, want, strict=True))
    print(
        f"B={B} K={K} O={O} n_ang={n_ang}: "
        + ", ".join(f"{p} {e < 1e-12}" for p, e in worst.items())
    )

# %% [markdown]
# ## Measurements on the H200
#
# One capture (`python -m ecekern.captures 02_block_diagonal_gemm`; commit, date and
# command in every row). The floor of a cell is the larger of its DRAM bytes at the
# copy bandwidth and its flops at the GEMM ceiling of its precision, both measured in
# the methodology chapter.
#
# ### The Triton kernel's launch

# %% tags=["remove-input"]
ok = [r for r in launch if r.get("time_ms") not in ("", None)]
best = {}
for r in ok:
    if r["dtype"] not in best or r["time_ms"] < best[r["dtype"]]["time_ms"]:
        best[r["dtype"]] = r
for r in best.values():
    r["us"] = 1e3 * r["time_ms"]
    r["floor_us"] = 1e3 * r["floor_bytes_ms"]
md(
    captures.markdown_table(
        list(best.values()),
        {
            "dtype": "precision",
            "variant": "variant",
            "block_b": "BLOCK_B",
            "block_k": "BLOCK_K",
            "block_o": "BLOCK_O",
            "warps": "warps",
            "us": "time (us)",
            "floor_us": "DRAM floor (us)",
        },
        {"us": "{:.0f}", "floor_us": "{:.0f}"},
    )
)

# %% [markdown]
# ### The three paths over n_ang and precision

# %% tags=["remove-input"]
precs = sorted({r["dtype"] for r in sweep})
Es = sorted({r["E"] for r in sweep})
fig, axes = plt.subplots(1, len(precs), figsize=(4 * len(precs), 3.4), sharey=True)
for ax, prec in zip(axes, precs, strict=True):
    for path, color in (
        ("einsum", "#fc8d62"),
        ("dense", "#8da0cb"),
        ("triton", "#66c2a5"),
    ):
        rs = sorted(
            (
                r
                for r in sweep
                if (r["dtype"], r["path"], r["E"]) == (prec, path, Es[0])
            ),
            key=lambda r: r["n_ang"],
        )
        ax.semilogy(
            [r["n_ang"] for r in rs],
            [r["forward_ms"] for r in rs],
            "o-",
            color=color,
            label=path,
        )
    rs = sorted(
        (
            r
            for r in sweep
            if (r["dtype"], r["path"], r["E"]) == (prec, "einsum", Es[0])
        ),
        key=lambda r: r["n_ang"],
    )
    ax.semilogy(
        [r["n_ang"] for r in rs], [r["floor_ms"] for r in rs], "k:", label="floor"
    )
    ax.set_title(f"{prec}, E = {Es[0]}")
    ax.set_xlabel("n_ang")
axes[0].set_ylabel("forward, cos and sin (ms)")
axes[0].legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# ### The dispatch table
#
# `path="auto"` takes, per precision and n_ang, the faster of the einsum and the
# dense GEMM in this sweep (the Triton path loses every cell):

# %% tags=["remove-input"]
table = []
for prec in precs:
    for n_ang in sorted({r["n_ang"] for r in sweep}):
        try:
            e, d = cell("einsum", prec, Es[0], n_ang), cell("dense", prec, Es[0], n_ang)
        except StopIteration:
            continue
        table.append(
            {
                "prec": prec,
                "n_ang": n_ang,
                "e": e["forward_ms"],
                "d": d["forward_ms"],
                "win": "dense" if d["forward_ms"] < e["forward_ms"] else "einsum",
                "auto": linear.auto_path(
                    "cuda",
                    torch.bfloat16 if prec.startswith("bfloat16") else torch.float32,
                    n_ang,
                    tf32=prec.endswith("+tf32"),
                ),
            }
        )
md(
    captures.markdown_table(
        table,
        {
            "prec": "precision",
            "n_ang": "n_ang",
            "e": "einsum (ms)",
            "d": "dense (ms)",
            "win": "faster",
            "auto": "auto picks",
        },
        {"e": "{:.3f}", "d": "{:.3f}"},
    )
)

# %% [markdown]
# ## Exercises
#
# 1. The dense path does $n_\text{ang}$ times the needed flops. From the methodology
#    chapter's GEMM ceilings, at which $n_\text{ang}$ should the dense path stop
#    winning in bf16? Compare with the sweep.
# 2. The Triton kernel loads `[BLOCK_B, BLOCK_K, n_ang]` tiles with $n_\text{ang} = 3$
#    padded to 4 lanes. Count the bytes its loads move through L1 per byte of DRAM.
