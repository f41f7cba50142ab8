"""The layer kernels: one Triton kernel per layer of the mixing stack each way, its
gate, bias and residual in the epilogue, and how a cohort's planes run through them.

Formula (per edge e, order m, cos and sin alike; :mod:`ecekern.stack_layers`)::

    forward:   z = W[m] u (+ b at m = 0, cos);  out = u + gate(z)  (or z, ungated)
    backward:  du = W[m]^T d (+ r);  dz = gate'(z) du

A program owns ``BE`` edges and ``BN`` output features, for every order and for cos
and sin: the orders are block-diagonal, so it runs one ``(BE, F_in) x (F_in, BN)``
product per order and part, m = 0 first in the forward (its cos row makes the
gate's ``s = sigmoid(p)``) and m = 0 last in the backward (it needs
``sum_(m>=1) du_m z_m``). The gate, the bias and the residual add happen on the
accumulator before it is stored; nothing of a layer is written twice.

Shapes: planes ``(n_ang, 2, n, width)`` (order, cos/sin, edge, feature) in and out,
any order and part strides, rows contiguous; ``W (n_ang, F_out, F_in)`` contiguous
(W^T for the backward; ``(2, ...)`` split by
``ecekern._stack_common.split_tf32`` in ``"tf32x3"``).

Bytes (DRAM) and FLOPs: the stack's, in :mod:`ecekern.stack_layers`.

Precision (the kernels' names, ``ecekern._stack_common.kernel_precision``):
``tl.dot``'s ``"ieee"`` (strict fp32 FMA, and float64), ``"tf32"``,
``"tf32x3"`` (``hi lo + lo hi + hi hi``: W split once a call, the rows split in
registers, each inner chunk summed from zero and added to the accumulator in fp32)
and ``"bf16"`` (operands rounded to bfloat16, fp32 accumulation).

Status: tested against the reference in float64 (Triton's CPU interpreter) and
float32 (the H200), through :mod:`ecekern.stack_layers`.
"""

from __future__ import annotations

import torch

from .._stack_common import planes as _planes
from .._stack_common import split_tf32
from .._triton import INTERPRET, round_bf16, round_tf32, tl, triton

__all__ = ["TILES"]

#: Edges and output features a program, inner-product chunk, warps and pipeline
#: depth, per precision (H200 sweep, chapter 6).
TILES = {
    "ieee": (64, 64, 16, 4, 2),
    "tf32": (64, 32, 32, 4, 3),
    "tf32x3": (64, 32, 32, 4, 3),
    "bf16": (64, 32, 32, 4, 3),
}
#: Triton's CPU interpreter truncates to bfloat16 and multiplies bf16 wrongly; it
#: gets the same operands rounded in fp32 instead.
EMULATE_BF16 = tl.constexpr(INTERPRET)


# --------------------------------------------------------------------------------------
# the kernels
# --------------------------------------------------------------------------------------
@triton.jit
def _mm(a, row, ok, w, SWO: tl.constexpr, n0, KIN: tl.constexpr, BE: tl.constexpr,
        BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
        DT: tl.constexpr, SLO: tl.constexpr = 0):  # fmt: skip
    """``acc[e, n] = sum_i a[e, i] A[n0 + n, i]``, rows ``a + row[e] KIN``, with
    ``A[o, i]`` at ``w + o SWO + i`` (W, or W^T made contiguous). In ``"tf32x3"``
    A is its TF32 part, and ``w + SLO`` the remainder (``split_tf32``)."""
    # [book: layer-mm]
    kk = tl.arange(0, BK)
    n = n0 + tl.arange(0, BN)
    acc = tl.zeros((BE, BN), DT)
    for k0 in range(0, KIN, BK):
        at = w + n[None, :] * SWO + (k0 + kk)[:, None]
        wt = tl.load(at)  # (in, out)
        x = tl.load(a + row[:, None] * KIN + (k0 + kk)[None, :], mask=ok[:, None],
                    other=0.0)  # fmt: skip
        if PREC == "tf32x3":  # lo hi + hi lo + hi hi, each a TF32 product
            x_hi = round_tf32(x)
            c = tl.dot(x - x_hi, wt, input_precision="tf32", out_dtype=DT)
            c = tl.dot(x_hi, tl.load(at + SLO), c, input_precision="tf32",
                       out_dtype=DT)  # fmt: skip
            # a chunk's sum starts at zero and joins acc in an fp32 add: summing
            # every chunk into acc on the tensor cores lost most of the split's
            # accuracy on the H200 (chapter 6's lab notes)
            acc += tl.dot(x_hi, wt, c, input_precision="tf32", out_dtype=DT)
        elif PREC == "bf16" and EMULATE_BF16:  # the interpreter's bf16 dot is wrong
            acc = tl.dot(round_bf16(x), round_bf16(wt), acc, input_precision="ieee")
        elif PREC == "bf16":
            acc = tl.dot(x.to(tl.bfloat16), wt.to(tl.bfloat16), acc, out_dtype=DT)
        else:
            acc = tl.dot(x, wt, acc, input_precision=PREC, out_dtype=DT)
    return acc
    # [/book: layer-mm]


@triton.jit
def _tile(E, NOUT: tl.constexpr, BE: tl.constexpr, BN: tl.constexpr):
    """This program's ``BE`` edges ``e`` (int64) and ``BN`` output features from
    ``n0`` (``n``, a row vector), with the row mask ``ok`` and its column ``okk``;
    the ``NOUT / BN`` feature blocks of an edge block are neighbouring programs."""
    NB: tl.constexpr = NOUT // BN
    pid = tl.program_id(0)
    e = (pid // NB).to(tl.int64) * BE + tl.arange(0, BE)
    n0 = (pid % NB) * BN
    n = n0 + tl.arange(0, BN)[None, :]
    ok = e < E
    return e, n0, n, ok, ok[:, None]


@triton.jit(do_not_specialize=["E"])
def _layer_fwd_kernel(a, sa_m, sa_c, w, b, z, sz_m, sz_c, o, so_m, so_c, E,
                      KIN: tl.constexpr, NOUT: tl.constexpr, NA: tl.constexpr,
                      BE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      GATE: tl.constexpr, HAS_B: tl.constexpr, KEEP: tl.constexpr,
                      SIN0: tl.constexpr, PREC: tl.constexpr,
                      DT: tl.constexpr):  # fmt: skip
    """One layer for BE edges and BN outputs, planes in and out (``x[m, c, e, i]``
    at ``x + m s_m + c s_c + e width + i``): ``z = W u (+ b)``; with ``GATE``,
    ``u + gate(z)`` is the output (and z is kept with ``KEEP``), else z is. With
    ``SIN0`` the m = 0 sin planes are zero and are neither read nor written."""
    sa_m, sa_c = tl.cast(sa_m, tl.int64), tl.cast(sa_c, tl.int64)  # z: all E rows
    sz_m, sz_c = tl.cast(sz_m, tl.int64), tl.cast(sz_c, tl.int64)
    so_m, so_c = tl.cast(so_m, tl.int64), tl.cast(so_c, tl.int64)
    # [book: layer-fwd]
    e, n0, n, ok, okk = _tile(E, NOUT, BE, BN)
    s = tl.zeros((BE, BN), DT)
    for m in tl.static_range(NA):  # m = 0 first: its cos row makes the gate
        for c in tl.static_range(2):  # cos, sin
            if m > 0 or c == 0 or not SIN0:
                src = a + m * sa_m + c * sa_c
                acc = _mm(src, e, ok, w + m * NOUT * KIN, KIN, n0, KIN, BE, BN, BK,
                          PREC, DT, NA * NOUT * KIN)  # fmt: skip
                if HAS_B and m == 0 and c == 0:
                    acc += tl.load(b + n)
                at = e[:, None] * NOUT + n
                if GATE:
                    if KEEP:
                        tl.store(z + m * sz_m + c * sz_c + at, acc, mask=okk)
                    if m == 0 and c == 0:  # SiLU on p
                        s = tl.sigmoid(acc)
                        acc = acc * s
                    elif m > 0:  # the m = 0 sin rows pass ungated
                        acc = acc * s
                    acc += tl.load(src + at, mask=okk, other=0.0)  # residual, F_in = F
                tl.store(o + m * so_m + c * so_c + at, acc, mask=okk)
    # [/book: layer-fwd]


@triton.jit(do_not_specialize=["E"])
def _layer_bwd_kernel(d, sd_m, sd_c, w, r, sr_m, sr_c, z, sz_m, sz_c, u, su_m, su_c,
                      dz, sdz_m, sdz_c, E,
                      KIN: tl.constexpr, NOUT: tl.constexpr, NA: tl.constexpr,
                      BE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      RES: tl.constexpr, GATE: tl.constexpr, SIN0: tl.constexpr,
                      PREC: tl.constexpr, DT: tl.constexpr):  # fmt: skip
    """One stage of the backward for BE edges and BN features, planes as in the
    forward: ``du = W^T d (+ r)`` into u; with ``GATE``, also ``dz = gate'(z) du``
    for the layer below's kept z. ``SIN0``: the m = 0 sin planes are skipped."""
    sd_m, sd_c = tl.cast(sd_m, tl.int64), tl.cast(sd_c, tl.int64)
    sr_m, sr_c = tl.cast(sr_m, tl.int64), tl.cast(sr_c, tl.int64)
    sz_m, sz_c = tl.cast(sz_m, tl.int64), tl.cast(sz_c, tl.int64)
    su_m, su_c = tl.cast(su_m, tl.int64), tl.cast(su_c, tl.int64)
    sdz_m, sdz_c = tl.cast(sdz_m, tl.int64), tl.cast(sdz_c, tl.int64)
    e, n0, n, ok, okk = _tile(E, NOUT, BE, BN)
    at = e[:, None] * NOUT + n
    t = tl.zeros((BE, BN), DT)  # sum over m >= 1 of du_m z_m
    for mi in tl.static_range(NA):
        m = (mi + 1) % NA  # m = 1 .. n_ang - 1, then 0 (a constexpr)
        for cc in tl.static_range(2):
            c = 1 - cc  # sin, then cos: m = 0's cos is the very last
            if m > 0 or c == 0 or not SIN0:
                acc = _mm(d + m * sd_m + c * sd_c, e, ok, w + m * KIN * NOUT, KIN, n0,
                          KIN, BE, BN, BK, PREC, DT, NA * KIN * NOUT)  # fmt: skip
                if RES:
                    acc += tl.load(r + m * sr_m + c * sr_c + at, mask=okk, other=0.0)
                tl.store(u + m * su_m + c * su_c + at, acc, mask=okk)
                if GATE:
                    if m > 0 or c == 0:  # (the m = 0 sin rows pass ungated)
                        p = tl.load(z + at, mask=okk, other=0.0)  # m = 0, cos
                        sg = tl.sigmoid(p)
                        if m > 0:
                            zm = tl.load(z + m * sz_m + c * sz_c + at, mask=okk,
                                         other=0.0)  # fmt: skip
                            t += acc * zm
                            acc = acc * sg
                        else:
                            acc = acc * sg + (acc * p + t) * (sg * (1 - sg))
                    tl.store(dz + m * sdz_m + c * sdz_c + at, acc, mask=okk)


# --------------------------------------------------------------------------------------
# the launchers
# --------------------------------------------------------------------------------------
def _block(n: int) -> int:
    """An output block: the largest power of two up to 64 dividing n."""
    return min(64, n & -n)


def _launch(kernel, E: int, NOUT: int, precision: str, tiles, *args, **meta):
    BE, BN, BK, warps, stages = tiles or TILES[precision]
    BN = min(BN, _block(NOUT))
    BK = min(BK, _block(meta["KIN"]))
    grid = (triton.cdiv(E, BE) * (NOUT // BN),)
    kernel[grid](*args, E, NOUT=NOUT, BE=BE, BN=BN, BK=BK, PREC=precision,
                 num_warps=warps, num_stages=stages, **meta)  # fmt: skip


def _weights(ws, precision: str):
    """The kernels' form of each weight: contiguous, split in ``"tf32x3"``."""
    if precision == "tf32x3":
        return [split_tf32(w) for w in ws]
    return [w.contiguous() for w in ws]


def _dt(dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _forward_cohort(src, n, zk, ws, bs, u, yp, F, FO, n_ang, precision, tiles, dt,
                    keep, sin0):  # fmt: skip
    """The gated layers (``K = len(bs) - 1``) and the output layer on one cohort's
    planes ``src`` (n rows), through the two ``u`` buffers into the planes ``yp``
    (n rows); z into ``zk (K, n_ang, 2, n, F)`` with ``keep``. ``yp`` None: the
    gated layers only, the output layer's weight and bias are not used."""
    K = len(bs) - 1
    for k in range(K + 1 if yp is not None else K):
        last = k == K
        dst = yp if last else u[(k + 1) % 2][:, :, :n]
        z = zk[min(k, K - 1)] if K and keep else dst
        _launch(_layer_fwd_kernel, n, FO if last else F, precision, tiles,
                *_planes(src), ws[k], ws[k] if bs[k] is None else bs[k],
                z, z.stride(0), z.stride(1), *_planes(dst),
                KIN=F, NA=n_ang, GATE=not last, HAS_B=bs[k] is not None,
                KEEP=keep, SIN0=sin0, DT=_dt(dt))  # fmt: skip
        src = dst


def _backward_cohort(src, n, zk, wt, du, dz, F, FO, n_ang, precision, tiles, dt,
                     sin0, final=None):  # fmt: skip
    """The backward of one cohort from the output gradient's planes ``src`` and its
    kept ``zk (K, n_ang, 2, n, F)``: the planes of dx, into ``final`` (n rows) when
    given, else one of ``du``."""
    K, res = len(wt) - 1, None
    for i, k in enumerate(reversed(range(K + 1))):  # W_out, then W_K .. W_1
        gate = k > 0  # dz for the layer below, from its z
        out, dzk = du[i % 2][:, :, :n], dz[i % 2][:, :, :n]
        if k == 0 and final is not None:
            out = final
        z = zk[k - 1] if gate else out
        r = out if res is None else res
        _launch(_layer_bwd_kernel, n, F, precision, tiles,
                *_planes(src), wt[k], *_planes(r),
                z, z.stride(0), z.stride(1), *_planes(out), *_planes(dzk),
                KIN=FO if k == K else F, NA=n_ang, RES=res is not None,
                GATE=gate, SIN0=sin0, DT=_dt(dt))  # fmt: skip
        src, res = dzk, out
    return res
