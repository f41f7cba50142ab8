"""The mixing stack's forward in one kernel: a tile of edges runs every layer on chip.

Formula (:func:`ecekern.reference.mixing_stack`), for each edge e and order m, cos and
sin alike (the gate couples the orders of a row through its m = 0 cos value p)::

    u_0 = x;  z_k = W_k[m] u_(k-1) (+ b_k at m = 0, cos);  u_k = u_(k-1) + gate(z_k)
    y = W_out[m] u_K (+ b_out at m = 0, cos)

Shapes: ``x_cos, x_sin (E, F, n_ang)``; ``W_k (n_ang, F, F)``; ``W_out (n_ang, F', F)``;
outputs ``y_cos, y_sin (E, F', n_ang)`` and the pre-activations ``z_k`` (cos, sin),
each ``(E, F, n_ang)``, which the force step's backward
(:func:`ecekern.cohorts._input_backward`) reads instead of recomputing them.

One program takes ``BE`` edges at a time (a persistent loop over tiles). The tile's
activations, ``2 n_ang BE F`` values (cos and sin), live in a scratch of two
buffers per program (layer k reads one, writes the other), a gate row of
``BE F`` values beside them; the scratch is sized by the number of programs, not by
E, so that it stays in L2. Each output chunk of ``BC`` features is a sum of
``(BE, BC) x (BC, BC)`` products over the input chunks, with W read from L2 by
every tile. ``tl.debug_barrier`` orders a layer's writes before the next layer's
reads.

Bytes model (DRAM): x in, y and the K pre-activations out: ``(2 F n_ang (1 + K) +
2 F' n_ang) E`` values per call; the weights, ``(K F + F') F n_ang`` values, once
into L2. FLOPs: ``4 n_ang (K F^2 + F' F) E``.

Precision: ``"ieee"`` (strict fp32 FMA, and float64), ``"tf32"``, ``"tf32x3"``
(Triton's three-pass TF32, fp32-accurate) for float32 inputs.

Gradients: none here; :func:`ecekern.cohorts.mixing_stack` with ``fused=True`` uses
it for the forward and takes its backward from the kept ``z_k``.

Status: tested in Triton's CPU interpreter against the reference in float64; not yet
compiled or measured on a GPU, so nothing uses it by default.
"""

from __future__ import annotations

import math

import torch

from .._triton import INTERPRET, tl, triton, why_not_triton

__all__ = ["PRECISIONS", "fused_forward", "why_not_fused"]

#: ``tl.dot``'s input precisions this kernel accepts.
PRECISIONS = ("ieee", "tf32", "tf32x3")
#: Edges a tile (the rows of each product, cos and sin separately).
BLOCK_EDGES = 16


# --------------------------------------------------------------------------------------
# the kernel
# --------------------------------------------------------------------------------------
@triton.jit
def _lin_chunk(src, PART, w, c, F: tl.constexpr, BE: tl.constexpr, BC: tl.constexpr,
               PREC: tl.constexpr, DT: tl.constexpr):  # fmt: skip
    """Output chunk ``c`` of one order, cos and sin: ``sum_i src[:, i] W[c + o, i]``,
    two ``(BE, BC)`` accumulators; ``src`` is the order's cos block (``BE`` rows of F),
    the sin block ``PART`` values after it; ``w`` is that order's ``(out, F)``."""
    r = tl.arange(0, BE)[:, None]
    j = tl.arange(0, BC)[None, :]
    ii = tl.arange(0, BC)[:, None]
    acc_c = tl.zeros((BE, BC), DT)
    acc_s = tl.zeros((BE, BC), DT)
    for i in range(0, F, BC):
        wt = tl.load(w + (c + j) * F + i + ii)  # (in, out): W[c + o, i + ii]
        a_c = tl.load(src + r * F + i + j)
        a_s = tl.load(src + PART + r * F + i + j)
        acc_c = tl.dot(a_c, wt, acc_c, input_precision=PREC, out_dtype=DT)
        acc_s = tl.dot(a_s, wt, acc_s, input_precision=PREC, out_dtype=DT)
    return acc_c, acc_s


@triton.jit(do_not_specialize=["E", "n_tiles"])
def _stack_fwd_kernel(x_cos, x_sin, w_all, b_all, w_out, b_out, y_cos, y_sin, z, scr,
                      gate, E, n_tiles, F: tl.constexpr, FO: tl.constexpr,
                      NA: tl.constexpr, K: tl.constexpr,
                      BE: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr,
                      DT: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    r = tl.arange(0, BE)[:, None]
    j = tl.arange(0, BC)[None, :]
    PART = NA * BE * F  # the sin half of a buffer
    BUF = 2 * PART
    mine = scr + pid.to(tl.int64) * (2 * BUF)
    my_gate = gate + pid.to(tl.int64) * (BE * F)
    EFA = tl.cast(E, tl.int64) * (F * NA)  # one (E, F, n_ang) tensor
    for t in range(pid, n_tiles, nprog):
        e = tl.cast(t, tl.int64) * BE + r
        ok = e < E
        for m in tl.static_range(NA):  # x into buffer 0
            for c in range(0, F, BC):
                at = e * (F * NA) + (c + j) * NA + m
                here = mine + m * (BE * F) + r * F + c + j
                tl.store(here, tl.load(x_cos + at, mask=ok, other=0.0))
                tl.store(here + PART, tl.load(x_sin + at, mask=ok, other=0.0))
        tl.debug_barrier()
        for k in tl.static_range(K):
            src = mine + (k % 2) * BUF
            dst = mine + ((k + 1) % 2) * BUF
            for m in tl.static_range(NA):
                for c in range(0, F, BC):
                    w = w_all + (k * NA + m) * F * F
                    acc_c, acc_s = _lin_chunk(
                        src + m * (BE * F), PART, w, c, F, BE, BC, PREC, DT
                    )
                    if m == 0:
                        acc_c += tl.load(b_all + k * F + c + j)
                    at = 2 * k * EFA + e * (F * NA) + (c + j) * NA + m
                    tl.store(z + at, acc_c, mask=ok)
                    tl.store(z + EFA + at, acc_s, mask=ok)
                    if m == 0:  # SiLU on p, the row's gate s = sigmoid(p) kept
                        s = tl.sigmoid(acc_c)
                        tl.store(my_gate + r * F + c + j, s)
                        g_c = acc_c * s
                        g_s = acc_s
                    else:
                        s = tl.load(my_gate + r * F + c + j)
                        g_c = acc_c * s
                        g_s = acc_s * s
                    here = m * (BE * F) + r * F + c + j
                    tl.store(dst + here, tl.load(src + here) + g_c)
                    tl.store(dst + PART + here, tl.load(src + PART + here) + g_s)
                if m == 0:
                    tl.debug_barrier()  # the gate row, before the orders m >= 1
            tl.debug_barrier()
        src = mine + (K % 2) * BUF
        for m in tl.static_range(NA):
            for c in range(0, FO, BC):
                acc_c, acc_s = _lin_chunk(
                    src + m * (BE * F), PART, w_out + m * FO * F, c, F, BE, BC, PREC,
                    DT,
                )  # fmt: skip
                if m == 0:
                    acc_c += tl.load(b_out + c + j)
                at = e * (FO * NA) + (c + j) * NA + m
                tl.store(y_cos + at, acc_c, mask=ok)
                tl.store(y_sin + at, acc_s, mask=ok)
        tl.debug_barrier()  # the next tile overwrites the buffers


# --------------------------------------------------------------------------------------
# the launcher
# --------------------------------------------------------------------------------------
def _chunk(F: int, FO: int) -> int:
    """The feature chunk: the largest power of two up to 64 dividing F and F'."""
    g = math.gcd(F, FO)
    return min(64, g & -g)


def why_not_fused(x_cos, weights, weight_out, precision: str) -> str | None:
    """Why the kernel cannot serve a call, or None."""
    why = why_not_triton(x_cos.device.type)
    if why:
        return why
    if x_cos.dtype not in (torch.float32, torch.float64):
        return f"dtype {x_cos.dtype} (float32 and float64 only)"
    if precision not in PRECISIONS:
        return f"precision {precision!r} is not one of {PRECISIONS}"
    if x_cos.dtype == torch.float64 and precision != "ieee":
        return f"float64 takes precision 'ieee', not {precision!r}"
    n_ang, FO, F = weight_out.shape
    if _chunk(F, FO) < 16:
        return f"F = {F} and F' = {FO} need a common power-of-two factor of 16"
    return None


def fused_forward(x_cos, x_sin, weights, biases, weight_out, bias_out,
                  precision: str = "ieee"):  # fmt: skip
    """``(y_cos, y_sin, [z_1 cos, z_1 sin, ..., z_K cos, z_K sin])`` of the stack on
    rows ``(E, F, n_ang)`` (made contiguous); the caller checks
    :func:`why_not_fused` first."""
    n_ang, FO, F = weight_out.shape
    E, K, dev, dt = x_cos.shape[0], len(weights), x_cos.device, x_cos.dtype
    xc, xs = x_cos.contiguous(), x_sin.contiguous()
    w_all = torch.stack([w.to(dt) for w in weights]) if K else xc.new_zeros(1)
    b_all = torch.stack(
        [xc.new_zeros(F) if b is None else b.to(dt) for b in biases]
    ) if K else xc.new_zeros(1)  # fmt: skip
    b_out = xc.new_zeros(FO) if bias_out is None else bias_out.to(dt).contiguous()
    y_cos = xc.new_empty((E, FO, n_ang))
    y_sin = torch.empty_like(y_cos)
    z = xc.new_empty((K, 2, E, F, n_ang))
    BE, BC = BLOCK_EDGES, _chunk(F, FO)
    n_tiles = triton.cdiv(E, BE)
    if n_tiles:
        sms = 4 if INTERPRET or dev.type != "cuda" else (
            torch.cuda.get_device_properties(dev).multi_processor_count
        )  # fmt: skip
        nprog = min(n_tiles, sms)
        scr = xc.new_empty(nprog * 4 * n_ang * BE * F)
        gate = xc.new_empty(nprog * BE * F)
        w_o = weight_out.to(dt).contiguous()
        _stack_fwd_kernel[(nprog,)](
            xc, xs, w_all.contiguous(), b_all.contiguous(), w_o, b_out, y_cos, y_sin,
            z, scr, gate, E, n_tiles, F, FO, NA=n_ang, K=K, BE=BE, BC=BC,
            PREC=precision, DT=tl.float64 if dt == torch.float64 else tl.float32,
        )  # fmt: skip
    zs = [z[k, p] for k in range(K) for p in range(2)]
    return y_cos, y_sin, zs
