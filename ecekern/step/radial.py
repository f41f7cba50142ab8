"""The radial stage, fused: edge lengths in, the radial features out (chapter 7).

Formula (per edge e; ``u`` the envelope, ``x = d / r_c``, p = 6; basis n = 1..n_rbf)::

    u(x)      = 1 - (p+1)(p+2)/2 x^p + p(p+2) x^(p+1) - p(p+1)/2 x^(p+2)  (0 past x = 1)
    b[e, n]   = sqrt(2/r_c) sin(n pi d_e / r_c) / d_e * u(x_e)
    h1        = silu(b W1^T + b1);  h2 = silu(h1 W2^T + b2);  y = h2 W3^T + b3
    radial[e] = y[e] * u(x_e)

    d (E,), W1 (H1, n_rbf), W2 (H2, H1), W3 (O, H2), biases (H1,), (H2,), (O,);
    radial (E, O). The chapter's sizes: n_rbf = 8, H1 = H2 = 64, O = L C + n_int F
    = 448.

This is :func:`radial_reference` (``reference.radial_basis``, ``reference.envelope``
and the model's SiLU MLP) in one kernel: a program owns ``BLOCK_E`` edges, computes
the basis and the envelope in registers (n_rbf padded to 16 columns, with zero
weights), the three layers with ``tl.dot`` (weights read per program, from L2), the
last layer ``BLOCK_O`` output columns at a time, and stores radial. Nothing between
d and radial touches DRAM.

Gradients. The force step's (``g = dLoss/dradial (E, O)``, no parameter gradients),
one kernel that recomputes the forward in the tile (no activations are kept)::

    g_d = sum_o g y * u'(d)  +  sum_n g_b[e, n] db[e, n]/dd
    g_b = (((g u) W3 * silu'(z2)) W2 * silu'(z1)) W1      (z_k the pre-activations)
    db/dd = sqrt(2/r_c) (k_n cos(k_n d) / d - sin(k_n d) / d^2) u + s_n u'(d)

(k_n = n pi / r_c, s_n the basis before the envelope: u enters twice). Where the
weights' gradients are used (training on energies), they come from the MLP's
forward again in PyTorch and its transposed products (:func:`_weight_grads`), d's
still from the kernel. With grad mode on in the backward (a second derivative:
training on forces) every gradient is differentiable PyTorch on
:func:`radial_reference` (``_autograd.torch_grads``).

Bytes model (DRAM, elements of the input dtype): forward reads d (E) and writes
radial (E O); the backward reads d and g (E + E O) and writes g_d (E). The weights
``n_rbf H1 + H1 H2 + H2 O + H1 + H2 + O`` (about 34k, 135 KB in fp32) are read by
every program from L2: at ``BLOCK_E = 64`` about 2 KB of L2 reads per edge against
the 1.8 KB of radial it writes. FLOPs per edge: ``2 (16 H1 + H1 H2 + H2 O)`` forward
(68k at the chapter's sizes), about twice that again in the backward (its recompute,
then the transposed products). At E = 365k in fp32: 654 MB written, 24 GFLOP forward.
The composition it replaces writes and reads the basis, both hidden layers (pre- and
post-activation) and y before the envelope's product.

Precision (``precision``): ``"fp32"`` (strict: ``tl.dot``'s ``"ieee"``; the only one
for float64), ``"3xtf32"`` (``hi lo + lo hi + hi hi``, the weights split once a call)
and ``"tf32"``, for float32. Triton's CPU interpreter computes TF32 products in full
precision.

Status: float32 and float64; any E (int64 offsets; E = 0 launches nothing); n_rbf
up to 64, hidden widths up to 128 (padded to powers of two, at least 16), any O;
any strides of d and g (the weights are made contiguous). Registered as
``torch.library`` ops (``ecekern::radial_fwd``, ``ecekern::radial_bwd_d``) with fake
implementations, inside one autograd Function (:mod:`ecekern._autograd`'s style).
Tested against the reference in float64 and float32 in Triton's CPU interpreter;
not yet run or timed on a GPU (its test is marked ``gpu``); launch untuned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import options, reference
from .._autograd import engine_uses, grad_node, library_op, torch_grads, wrap_triton
from .._stack_common import PRECISIONS, kernel_precision, split_tf32
from .._triton import round_tf32, split_scale, tl, triton, why_not_triton

__all__ = ["RadialLaunch", "radial", "radial_reference", "why_not"]

#: The envelope's exponent p (``reference.envelope``'s default, the model's).
ENVELOPE_P = 6
#: The largest n_rbf and hidden widths the kernels hold in registers.
MAX_RBF, MAX_HIDDEN = 64, 128


# --------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------
@triton.jit
def _mm(a, w_ptr, offs_i, offs_o, IN: tl.constexpr, OUT: tl.constexpr, acc,
        FWD: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """``acc + a @ W[offs_o, offs_i]^T`` (``FWD``, a ``[BLOCK_E, len(offs_i)]``) or
    ``acc + a @ W[offs_o, offs_i]`` (a ``[BLOCK_E, len(offs_o)]``) for a row-major
    ``W (OUT, IN)``, zero past its edges; in ``"tf32x3"`` W is its TF32 part and the
    remainder follows it (``split_tf32``)."""
    if FWD:  # the tile W^T [IN_PAD, OUT_PAD]
        at = w_ptr + offs_o[None, :] * IN + offs_i[:, None]
        mask = (offs_i < IN)[:, None] & (offs_o < OUT)[None, :]
    else:  # the tile W [OUT_PAD, IN_PAD]
        at = w_ptr + offs_o[:, None] * IN + offs_i[None, :]
        mask = (offs_o < OUT)[:, None] & (offs_i < IN)[None, :]
    w = tl.load(at, mask=mask, other=0.0)
    if PREC == "tf32x3":  # lo hi + hi lo + hi hi, each a TF32 product
        a_hi = round_tf32(a)
        c = tl.dot(a - a_hi, w, input_precision="tf32")
        w_lo = tl.load(at + OUT * IN, mask=mask, other=0.0)
        c = tl.dot(a_hi, w_lo, c, input_precision="tf32")
        acc += tl.dot(a_hi, w, c, input_precision="tf32")
    else:
        acc = tl.dot(a, w, acc, input_precision=PREC, out_dtype=acc.dtype)
    return acc


@triton.jit
def _bias(b_ptr, offs, N: tl.constexpr):
    """The bias as a row ``[1, len(offs)]``, zero past N."""
    return tl.load(b_ptr + offs, mask=offs < N, other=0.0)[None, :]


@triton.jit
def _sigmoid(z):
    return 1.0 / (1.0 + tl.exp(-z))


@triton.jit
def _basis(d, cst, NR: tl.constexpr, NR_PAD: tl.constexpr, P: tl.constexpr,
           DT: tl.constexpr):  # fmt: skip
    """The envelope ``u``, ``du/dd``, the basis ``b [BLOCK_E, NR_PAD]`` (zero past
    n_rbf) and ``db/dd``, of the lengths ``d [BLOCK_E]``, as the reference rounds
    them (``x = d / r_c`` exactly 1 at the cutoff). ``cst`` holds ``r_c``, pi and
    ``sqrt(2/r_c)``, each as an fp32 pair ``hi + lo`` summed in DT: Triton passes
    Python floats as fp32, and float64 needs their 48 bits."""
    rc = tl.zeros_like(d) + cst[0] + cst[1]
    norm = tl.zeros_like(d) + cst[4] + cst[5]
    # 1. envelope: u = 1 + x^p (-A + x (B - C x)), du/dx = x^(p-1) (-pA + ...)
    x = d / rc
    xp1 = x  # x^(p-1)
    for _ in tl.static_range(P - 2):
        xp1 = xp1 * x
    A: tl.constexpr = (P + 1) * (P + 2) // 2
    B: tl.constexpr = P * (P + 2)
    C: tl.constexpr = P * (P + 1) // 2
    u = 1.0 + xp1 * x * (x * (B - C * x) - A)
    du = xp1 * (x * (B * (P + 1) - C * (P + 2) * x) - A * P) / rc
    inside = x < 1.0
    u = tl.where(inside, u, 0.0)
    du = tl.where(inside, du, 0.0)
    # 2. Bessel basis [BLOCK_E, NR_PAD]: columns past n_rbf are zero
    offs_n = tl.arange(0, NR_PAD)
    n_pi = (offs_n + 1).to(DT) * (tl.zeros([NR_PAD], DT) + cst[2] + cst[3])
    arg = n_pi[None, :] * d[:, None] / rc[:, None]
    k = n_pi[None, :] / rc[:, None]
    sn = tl.sin(arg)
    inv_d = (1.0 / d)[:, None]
    s = norm[:, None] * sn * inv_d
    ds = norm[:, None] * (k * tl.cos(arg) - sn * inv_d) * inv_d
    keep = (offs_n < NR)[None, :]
    b = tl.where(keep, s * u[:, None], 0.0)
    db = tl.where(keep, ds * u[:, None] + s * du[:, None], 0.0)
    return u, du, b, db


@triton.jit
def _hidden(b, w, NR: tl.constexpr, H1: tl.constexpr, H2: tl.constexpr,
            NR_PAD: tl.constexpr, H1_PAD: tl.constexpr, H2_PAD: tl.constexpr,
            BLOCK_E: tl.constexpr, PREC: tl.constexpr,
            DT: tl.constexpr):  # fmt: skip
    """The pre-activations z1, z2 and h2 = silu(z2) of the basis ``b``; ``w`` holds
    the pointers of W1, b1, W2, b2. Padded hidden columns are zero (silu(0) = 0)."""
    w1, b1, w2, b2 = w
    offs_n = tl.arange(0, NR_PAD)
    offs_1 = tl.arange(0, H1_PAD)
    offs_2 = tl.arange(0, H2_PAD)
    z1 = _mm(b, w1, offs_n, offs_1, NR, H1, tl.zeros([BLOCK_E, H1_PAD], DT), True,
             PREC) + _bias(b1, offs_1, H1)  # fmt: skip
    h1 = z1 * _sigmoid(z1)
    z2 = _mm(h1, w2, offs_1, offs_2, H1, H2, tl.zeros([BLOCK_E, H2_PAD], DT), True,
             PREC) + _bias(b2, offs_2, H2)  # fmt: skip
    return z1, z2, z2 * _sigmoid(z2)


@triton.jit(do_not_specialize=["E"])
def _radial_fwd_kernel(
    # pointers
    d_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, w3_ptr, b3_ptr, out_ptr,
    # sizes
    E, rc_hi, rc_lo, pi_hi, pi_lo, norm_hi, norm_lo,
    # strides
    stride_d, stride_o_e, stride_o_o,
    # meta-parameters
    NR: tl.constexpr, H1: tl.constexpr, H2: tl.constexpr, O: tl.constexpr,
    NR_PAD: tl.constexpr, H1_PAD: tl.constexpr, H2_PAD: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_O: tl.constexpr, P: tl.constexpr,
    PREC: tl.constexpr, DT: tl.constexpr,
):  # fmt: skip
    """One block of edges: ``radial [BLOCK_E, O]`` from ``d [BLOCK_E]``."""
    pid = tl.program_id(0).to(tl.int64)  # int64: E O passes 2^31 at 5M edges
    offs_e = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    mask_e = offs_e < E
    # masked lanes read a length of 1: finite values, never stored
    d = tl.load(d_ptr + offs_e * stride_d, mask=mask_e, other=1.0)
    # 1. basis and envelope in registers [BLOCK_E, NR_PAD]
    cst = (rc_hi, rc_lo, pi_hi, pi_lo, norm_hi, norm_lo)
    u, du, b, db = _basis(d, cst, NR, NR_PAD, P, DT)
    # 2. the hidden layers [BLOCK_E, H_PAD]
    w = (w1_ptr, b1_ptr, w2_ptr, b2_ptr)
    z1, z2, h2 = _hidden(b, w, NR, H1, H2, NR_PAD, H1_PAD, H2_PAD, BLOCK_E, PREC, DT)
    # 3. the output layer BLOCK_O columns at a time, times the envelope
    offs_2 = tl.arange(0, H2_PAD)
    for o0 in range(0, O, BLOCK_O):
        offs_o = o0 + tl.arange(0, BLOCK_O)
        y = _mm(h2, w3_ptr, offs_2, offs_o, H2, O, tl.zeros([BLOCK_E, BLOCK_O], DT),
                True, PREC) + _bias(b3_ptr, offs_o, O)  # fmt: skip
        tl.store(
            out_ptr + offs_e[:, None] * stride_o_e + offs_o[None, :] * stride_o_o,
            (y * u[:, None]).to(out_ptr.dtype.element_ty),
            mask=mask_e[:, None] & (offs_o < O)[None, :],
        )


@triton.jit(do_not_specialize=["E"])
def _radial_bwd_d_kernel(
    # pointers
    g_ptr, d_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, w3_ptr, b3_ptr, gd_ptr,
    # sizes
    E, rc_hi, rc_lo, pi_hi, pi_lo, norm_hi, norm_lo,
    # strides
    stride_g_e, stride_g_o, stride_d,
    # meta-parameters
    NR: tl.constexpr, H1: tl.constexpr, H2: tl.constexpr, O: tl.constexpr,
    NR_PAD: tl.constexpr, H1_PAD: tl.constexpr, H2_PAD: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_O: tl.constexpr, P: tl.constexpr,
    PREC: tl.constexpr, DT: tl.constexpr,
):  # fmt: skip
    """One block of edges: ``g_d [BLOCK_E]`` (contiguous) from ``g [BLOCK_E, O]``,
    the forward recomputed in the tile."""
    pid = tl.program_id(0).to(tl.int64)
    offs_e = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    mask_e = offs_e < E
    d = tl.load(d_ptr + offs_e * stride_d, mask=mask_e, other=1.0)
    # 1. the forward again, up to h2
    cst = (rc_hi, rc_lo, pi_hi, pi_lo, norm_hi, norm_lo)
    u, du, b, db = _basis(d, cst, NR, NR_PAD, P, DT)
    w = (w1_ptr, b1_ptr, w2_ptr, b2_ptr)
    z1, z2, h2 = _hidden(b, w, NR, H1, H2, NR_PAD, H1_PAD, H2_PAD, BLOCK_E, PREC, DT)
    # 2. output layer by column blocks: sum_o g y (the envelope's outer factor) and
    # g_h2 = (g u) W3, accumulated over the blocks [BLOCK_E, H2_PAD]
    offs_2 = tl.arange(0, H2_PAD)
    gy = tl.zeros([BLOCK_E], DT)
    g_h2 = tl.zeros([BLOCK_E, H2_PAD], DT)
    for o0 in range(0, O, BLOCK_O):
        offs_o = o0 + tl.arange(0, BLOCK_O)
        mask_o = offs_o < O
        y = _mm(h2, w3_ptr, offs_2, offs_o, H2, O, tl.zeros([BLOCK_E, BLOCK_O], DT),
                True, PREC) + _bias(b3_ptr, offs_o, O)  # fmt: skip
        g = tl.load(
            g_ptr + offs_e[:, None] * stride_g_e + offs_o[None, :] * stride_g_o,
            mask=mask_e[:, None] & mask_o[None, :],
            other=0.0,
        ).to(DT)
        gy += tl.sum(g * y, axis=1)
        g_h2 = _mm(g * u[:, None], w3_ptr, offs_2, offs_o, H2, O, g_h2, False, PREC)
    # 3. through the hidden layers to the basis: silu'(z) = s (1 + z (1 - s))
    s2 = _sigmoid(z2)
    g_z2 = g_h2 * s2 * (1.0 + z2 * (1.0 - s2))
    offs_1 = tl.arange(0, H1_PAD)
    g_h1 = _mm(g_z2, w2_ptr, offs_1, offs_2, H1, H2, tl.zeros([BLOCK_E, H1_PAD], DT),
               False, PREC)  # fmt: skip
    s1 = _sigmoid(z1)
    g_z1 = g_h1 * s1 * (1.0 + z1 * (1.0 - s1))
    offs_n = tl.arange(0, NR_PAD)
    g_b = _mm(g_z1, w1_ptr, offs_n, offs_1, NR, H1, tl.zeros([BLOCK_E, NR_PAD], DT),
              False, PREC)  # fmt: skip
    # 4. both places the length enters: the basis and the envelope's outer factor
    g_d = tl.sum(g_b * db, axis=1) + gy * du
    tl.store(gd_ptr + offs_e, g_d.to(gd_ptr.dtype.element_ty), mask=mask_e)


# --------------------------------------------------------------------------------------
# launchers: check, allocate, launch
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RadialLaunch:
    """The kernels' launch: edges per program, output columns per block of the last
    layer, warps per program, and software-pipeline stages of the loops (1: the
    weights come from L2 and the book's backward in 3xTF32 needs 256 KB of shared
    memory at Triton's default of 3 stages, past sm_90's 227 KB; 48 KB at 1)."""

    block_e: int = 64
    block_o: int = 64
    warps: int = 4
    stages: int = 1


def _pad(n: int) -> int:
    """``n`` rounded up to a power of two, at least 16 (``tl.dot``'s smallest)."""
    return max(16, triton.next_power_of_2(n))


def _prepare(d, weights, cutoff: float, precision: str, launch: RadialLaunch):
    """The kernels' weights (contiguous; W split in ``"tf32x3"``), the scales as
    fp32 pairs, and the meta-parameters."""
    W1, b1, W2, b2, W3, b3 = weights
    # the widths pick compile-time tile shapes: plain ints, also while inductor
    # traces with symbolic sizes; E stays symbolic
    H1, NR = int(W1.shape[0]), int(W1.shape[1])
    H2, O = int(W2.shape[0]), int(W3.shape[0])
    prec = kernel_precision(precision)
    split = split_tf32 if prec == "tf32x3" else torch.Tensor.contiguous
    ws = (split(W1), b1.contiguous(), split(W2), b2.contiguous(), split(W3),
          b3.contiguous())  # fmt: skip
    cst = (*split_scale(cutoff), *split_scale(math.pi),
           *split_scale(math.sqrt(2.0 / cutoff)))  # fmt: skip
    meta = dict(
        NR=NR, H1=H1, H2=H2, O=O, NR_PAD=_pad(NR), H1_PAD=_pad(H1), H2_PAD=_pad(H2),
        BLOCK_E=launch.block_e, BLOCK_O=min(_pad(launch.block_o), _pad(O)),
        P=ENVELOPE_P, PREC=prec,
        DT=tl.float64 if d.dtype == torch.float64 else tl.float32,
        num_warps=launch.warps, num_stages=launch.stages,
    )  # fmt: skip
    return ws, cst, meta


def radial_fwd(
    d, weights, cutoff: float, precision: str, launch: RadialLaunch = RadialLaunch()
) -> torch.Tensor:
    """Launch the forward: ``radial (E, O)``, contiguous, from ``d (E,)`` (any
    stride) and ``weights = (W1, b1, W2, b2, W3, b3)`` (checked by :func:`radial`)."""
    E, O = d.shape[0], weights[4].shape[0]
    out = torch.empty((E, O), device=d.device, dtype=d.dtype)
    if E == 0:
        return out
    ws, cst, meta = _prepare(d, weights, cutoff, precision, launch)
    wrap_triton(_radial_fwd_kernel)[(triton.cdiv(E, launch.block_e),)](
        d, *ws, out, E, *cst, d.stride(0), out.stride(0), out.stride(1), **meta
    )
    return out


def radial_bwd_d(
    g, d, weights, cutoff: float, precision: str, launch: RadialLaunch = RadialLaunch()
) -> torch.Tensor:
    """Launch the force backward: ``g_d (E,)`` from ``g = dLoss/dradial (E, O)``
    (any strides), the forward recomputed."""
    E = d.shape[0]
    g_d = torch.empty((E,), device=d.device, dtype=d.dtype)
    if E == 0:
        return g_d
    ws, cst, meta = _prepare(d, weights, cutoff, precision, launch)
    wrap_triton(_radial_bwd_d_kernel)[(triton.cdiv(E, launch.block_e),)](
        g, d, *ws, g_d, E, *cst, g.stride(0), g.stride(1), d.stride(0), **meta
    )
    return g_d


# --------------------------------------------------------------------------------------
# torch.library ops, and the autograd Function around them
# --------------------------------------------------------------------------------------
def _fwd_fake(d, W1, b1, W2, b2, W3, b3, cutoff, precision):
    return d.new_empty((d.shape[0], W3.shape[0]))


@library_op("radial_fwd", _fwd_fake)
def _fwd_lib(
    d: torch.Tensor,
    W1: torch.Tensor,
    b1: torch.Tensor,
    W2: torch.Tensor,
    b2: torch.Tensor,
    W3: torch.Tensor,
    b3: torch.Tensor,
    cutoff: float,
    precision: str,
) -> torch.Tensor:
    return radial_fwd(d, (W1, b1, W2, b2, W3, b3), cutoff, precision)


def _bwd_fake(g, d, W1, b1, W2, b2, W3, b3, cutoff, precision):
    return d.new_empty((d.shape[0],))


@library_op("radial_bwd_d", _bwd_fake)
def _bwd_lib(
    g: torch.Tensor,
    d: torch.Tensor,
    W1: torch.Tensor,
    b1: torch.Tensor,
    W2: torch.Tensor,
    b2: torch.Tensor,
    W3: torch.Tensor,
    b3: torch.Tensor,
    cutoff: float,
    precision: str,
) -> torch.Tensor:
    return radial_bwd_d(g, d, (W1, b1, W2, b2, W3, b3), cutoff, precision)


def _weight_grads(g, d, params, cutoff: float, n_rbf: int, want):
    """The weights' gradients ``(gW1, gb1, gW2, gb2, gW3, gb3)`` (None where not in
    ``want``) by the MLP's forward again in PyTorch and its transposed products::

        gy = g u;  gW3 = gy^T h2;  g_z2 = (gy W3) silu'(z2);  gW2 = g_z2^T h1;
        g_z1 = (g_z2 W2) silu'(z1);  gW1 = g_z1^T b;  gb_k = sum_e g_z_k

    No ``autograd.grad`` inside: ``torch.compile`` traces it."""
    W1, b1, W2, b2, W3, b3 = params
    b = reference.radial_basis(d, n_rbf, cutoff)
    u = reference.envelope(d, cutoff)
    z1 = F.linear(b, W1, b1)
    h1 = F.silu(z1)
    z2 = F.linear(h1, W2, b2)
    h2 = F.silu(z2)
    gy = g * u[:, None]
    g_z2 = (gy @ W3) * _dsilu(z2)
    g_z1 = (g_z2 @ W2) * _dsilu(z1)
    grads = (g_z1.T @ b, g_z1.sum(0), g_z2.T @ h1, g_z2.sum(0), gy.T @ h2, gy.sum(0))
    return [t if w else None for t, w in zip(grads, want)]


def _dsilu(z):
    s = torch.sigmoid(z)
    return s * (1 + z * (1 - s))


class _RadialFn(torch.autograd.Function):
    """``(d, cutoff, n_rbf, precision, W1, b1, W2, b2, W3, b3) -> radial`` by the
    forward op. Backward: d's gradient by the backward op, the weights' (where
    used) by :func:`_weight_grads`; with grad mode on (a second derivative: training
    on forces) all of it by differentiable PyTorch on :func:`radial_reference`."""

    @staticmethod
    def forward(ctx, d, cutoff, n_rbf, precision, *params):
        ctx.save_for_backward(d, *params)
        ctx.meta = (cutoff, n_rbf, precision)
        tracing = torch.compiler.is_compiling()
        ctx.nodes = [None if tracing else grad_node(p) for p in params]
        return _fwd_lib(d, *params, cutoff, precision)

    @staticmethod
    def backward(ctx, g):
        d, *params = ctx.saved_tensors
        cutoff, n_rbf, precision = ctx.meta
        need = ctx.needs_input_grad
        if torch.compiler.is_compiling():  # the engine's plan is not traceable
            want = list(need[4:])
        else:  # the weights' gradients: not in a force step
            want = [n and engine_uses(node) for n, node in zip(need[4:], ctx.nodes)]
        if not need[0] and not any(want):
            return None, None, None, None, *(None,) * len(params)
        if torch.is_grad_enabled():  # a second derivative: differentiable PyTorch

            def fn(d, *p):
                return radial_reference(d, _pairs(p), cutoff, n_rbf)

            grads = torch_grads(fn, (d, *params), (need[0], *want), (g,))
            return grads[0], None, None, None, *grads[1:]
        g_w = [None] * len(params)
        if any(want):
            g_w = _weight_grads(g, d, params, cutoff, n_rbf, want)
        g_d = _bwd_lib(g, d, *params, cutoff, precision) if need[0] else None
        return g_d, None, None, None, *g_w


# --------------------------------------------------------------------------------------
# public functions
# --------------------------------------------------------------------------------------
def _pairs(params):
    return [(params[i], params[i + 1]) for i in range(0, len(params), 2)]


def radial_reference(d, weights, cutoff: float, n_rbf: int) -> torch.Tensor:
    """The composition the fused op replaces, in PyTorch (any number of layers):
    ``mlp(reference.radial_basis(d)) * reference.envelope(d)[:, None]``, the MLP's
    layers ``F.linear(h, W, b)`` with SiLU between them (the model's ``_silu_mlp``)."""
    h = reference.radial_basis(d, n_rbf, cutoff)
    u = reference.envelope(d, cutoff)
    for i, (W, b) in enumerate(weights):
        h = F.linear(h, W, b)
        if i < len(weights) - 1:
            h = F.silu(h)
    return h * u[:, None]


def why_not(
    device_type: str, dtype: torch.dtype, sizes, precision: str = "fp32"
) -> str | None:
    """Why the fused op cannot serve lengths of ``dtype`` on ``device_type`` through
    an MLP of layer widths ``sizes = [n_rbf, H1, ..., O]`` in ``precision``, or
    None."""
    reason = why_not_triton(device_type)
    if reason is not None:
        return reason
    if dtype not in (torch.float32, torch.float64):
        return f"dtype {dtype} (float32 and float64 only)"
    if precision not in PRECISIONS:
        return f"precision {precision!r} is not one of {PRECISIONS}"
    if dtype == torch.float64 and precision != "fp32":
        return f"float64 takes precision 'fp32', not {precision!r}"
    if precision == "bf16":
        return "precision 'bf16' (the radial kernels run fp32, 3xtf32 or tf32)"
    sizes = [int(n) for n in sizes]
    if len(sizes) != 4:
        return f"{len(sizes) - 1} linear layers (the kernels run three)"
    n_rbf, H1, H2, O = sizes
    if not 1 <= n_rbf <= MAX_RBF:
        return f"n_rbf = {n_rbf} is outside 1..{MAX_RBF}"
    if not (1 <= H1 <= MAX_HIDDEN and 1 <= H2 <= MAX_HIDDEN):
        return f"hidden widths {H1}, {H2} are outside 1..{MAX_HIDDEN}"
    if O < 1:
        return f"O = {O} output features"
    return None


def _check(d, weights, cutoff, n_rbf, precision) -> list[int]:
    """Types, shapes, dtypes and devices of :func:`radial`'s arguments; the widths."""
    if not isinstance(d, torch.Tensor):
        raise TypeError(f"d must be a torch.Tensor, got {type(d).__name__}")
    if not d.is_floating_point():
        raise TypeError(f"d must be a floating-point tensor, got {d.dtype}")
    if d.ndim != 1:
        raise ValueError(f"d must have shape (E,), got {tuple(d.shape)}")
    if isinstance(n_rbf, bool) or not isinstance(n_rbf, int) or n_rbf < 1:
        raise ValueError(f"n_rbf must be a positive int, got {n_rbf!r}")
    if isinstance(cutoff, bool) or not isinstance(cutoff, (int, float)):
        raise TypeError(f"cutoff must be a number, got {type(cutoff).__name__}")
    if not cutoff > 0:
        raise ValueError(f"cutoff must be positive, got {cutoff!r}")
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if d.dtype == torch.float64 and precision != "fp32":
        raise ValueError(f"float64 takes precision 'fp32', not {precision!r}")
    if not isinstance(weights, (list, tuple)) or not weights:
        raise TypeError("weights must be a non-empty list of (W, b) pairs")
    sizes = [n_rbf]
    for i, pair in enumerate(weights):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise TypeError(f"weights[{i}] must be a (W, b) pair")
        for name, t in zip(("W", "b"), pair):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"weights[{i}]'s {name} must be a torch.Tensor")
            if t.dtype != d.dtype:
                raise TypeError(
                    f"weights[{i}]'s {name} has dtype {t.dtype} but d has {d.dtype}"
                )
            if t.device != d.device:
                raise ValueError(
                    f"weights[{i}]'s {name} is on {t.device} but d is on {d.device}"
                )
        W, b = pair
        if W.ndim != 2 or W.shape[1] != sizes[-1]:
            raise ValueError(
                f"weights[{i}]'s W must have shape (out, {sizes[-1]}), got "
                f"{tuple(W.shape)}"
            )
        if b.shape != (W.shape[0],):
            raise ValueError(
                f"weights[{i}]'s b must have shape ({W.shape[0]},), got "
                f"{tuple(b.shape)}"
            )
        sizes.append(int(W.shape[0]))
    return sizes


def radial(
    d: torch.Tensor, weights, cutoff: float, n_rbf: int, precision: str = "fp32"
) -> torch.Tensor:
    """Computes the same as :func:`radial_reference`, fused: the radial features
    ``mlp(radial_basis(d)) * envelope(d)[:, None]``, ``(E,) -> (E, O)``.

    ``weights``: the MLP's ``(W, b)`` pairs, as the ``nn.Linear`` layers hold them
    (``[(l.weight, l.bias) for l in model.radial[::2]]``); three layers with SiLU
    between them. ``precision``: ``"fp32"`` (the only one for float64), ``"3xtf32"``
    or ``"tf32"`` (float32). Differentiable to any order: d's gradient by the
    backward kernel, the weights' by PyTorch (only where the backward pass uses
    them: a force step asks for none), a second derivative by differentiable
    PyTorch. Where :func:`why_not` gives a
    reason, the reference composition runs instead, announced once
    (``options.fallback``). Bad arguments raise TypeError or ValueError.
    """
    sizes = _check(d, weights, cutoff, n_rbf, precision)
    reason = why_not(d.device.type, d.dtype, sizes, precision)
    if reason is not None:
        options.fallback("radial", reason)
        return radial_reference(d, weights, float(cutoff), n_rbf)
    params = [t for pair in weights for t in pair]
    return _RadialFn.apply(d, float(cutoff), n_rbf, precision, *params)
