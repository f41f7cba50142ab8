"""The mixing stack a layer at a time, each layer one GEMM with its gate and residual
in the epilogue: forward, and the force backward.

Formula (:func:`ecekern.reference.mixing_stack`), for each edge e and order m, cos and
sin alike (the gate couples the orders of a row through its m = 0 cos value p)::

    u_0 = x;  z_k = W_k[m] u_(k-1) (+ b_k at m = 0, cos);  u_k = u_(k-1) + gate(z_k)
    y = W_out[m] u_K (+ b_out at m = 0, cos)

and the force step's backward (no parameter gradients), from the kept ``z_k``::

    du_K = W_out[m]^T dy;  dz_k = gate'(z_k) du_k;  du_(k-1) = du_k + W_k[m]^T dz_k
    dx = du_0

or, recomputing (:func:`stack_recompute_backward`), from x: each cohort's gated
layers run forward again into a cohort-sized z before its backward. With
``sin0_zero`` the m = 0 sin column of x is taken as zero (the m = 0 order has no
sin part); that plane then stays zero through every layer, and the kernels skip it
(``SIN0``): ``2 n_ang - 1`` products a layer instead of ``2 n_ang`` (five instead
of six at n_ang = 3), ``y_sin[..., 0] = 0`` and ``dx_sin[..., 0] = 0``.

One kernel per layer each way (:mod:`.kernels`), over cohorts of at most
``cohort_edges`` rows whose planes buffers are reused (``ecekern._stack_common``).

Shapes: ``x_cos, x_sin, dx_cos, dx_sin (E, F, n_ang)``, any strides;
``W_k (n_ang, F, F)``, ``W_out (n_ang, F', F)``; ``y, dy (E, F', n_ang)``. Between
layers the rows are *planes* ``(n_ang, 2, E, F)`` (order, cos/sin, edge, feature),
so that a product's operand rows are contiguous; the kept pre-activations are
``z (K, n_ang, 2, E, F)``. Rows that are a *planes pair*, the cos and sin views
``P[:, 0]``, ``P[:, 1]`` of one such ``P`` (chapter 3's ``planes=True``), are read
in place, and y (for planes x) and dx (for planes dy) are handed out as planes
pairs; other rows are copied into planes buffers a cohort at a time, and back.

Bytes model (DRAM, values of ``E F n_ang``, cos and sin): forward, each gated layer
reads u and writes z and u (6), the output layer reads u and writes y
(``2 + 2 F'/F``); backward, the top stage reads dy and z_K and writes du and dz
(``6 + 2 F'/F``), each middle stage reads dz, du and z and writes du and dz (10),
the last reads dz and du and writes dx (6). At K = 2, F' = F/2: 15 forward,
23 backward; copying rows that are not planes pairs adds 6 each way; with
``sin0_zero``, all
of it ``1 - 1/(2 n_ang)`` (five sixths at n_ang = 3). Recomputing adds the gated
layers' forward without z (8). FLOPs: ``4 n_ang (K F^2 + F' F) E`` each way (times
``1 - 1/(2 n_ang)`` with ``sin0_zero``).

Precision (``precision``, :data:`~ecekern.cohorts.PRECISIONS`): ``"fp32"`` (strict fp32
FMA; the only one for float64 rows), ``"3xtf32"`` (fp32-accurate: ``hi lo + lo hi + hi
hi`` in three TF32 products, W split once a call, the rows split in registers, each
inner chunk summed from zero and added to the accumulator in fp32), ``"tf32"`` and
``"bf16"`` (operands rounded to bfloat16, fp32 accumulation), for float32 rows. Triton's
CPU interpreter computes TF32 products in full precision (``"3xtf32"`` then lacks only
lo lo).

Gradients: these are the gradients (the backward kernels); no parameter gradients
(:func:`ecekern.cohorts.mixing_stack` computes those by recomputing cohorts).

Status: tested against the reference in float64 (Triton's CPU interpreter) and
float32 (the H200); the default force step's stack for float32 on CUDA, in 3xTF32
(:func:`ecekern.cohorts.mixing_stack`, ``kernels="layers"``). DRAM- and
latency-bound: about twice the bytes model in TF32 (chapter 6's Nsight captures).
"""

from __future__ import annotations

import functools

import torch

from .. import _stack_common as _c
from .._stack_common import COHORT_EDGES, PRECISIONS, kernel_precision
from .._triton import why_not_triton
from .kernels import _backward_cohort, _block, _forward_cohort, _weights

__all__ = [
    "PRECISIONS",
    "stack_backward",
    "stack_forward",
    "stack_recompute_backward",
    "why_not",
]

_WHO = "the layer kernels"


@functools.lru_cache(maxsize=64)
def why_not(precision: str, device_type: str, dtype, F: int, FO: int) -> str | None:
    """Why the layer kernels cannot serve a stack of widths ``F``, ``F'`` in
    ``precision`` (:data:`~ecekern.cohorts.PRECISIONS`) on ``device_type`` rows of
    ``dtype``, or None (cached)."""
    why = why_not_triton(device_type)
    if why:
        return why
    if dtype not in (torch.float32, torch.float64):
        return f"dtype {dtype} (float32 and float64 only)"
    if precision not in PRECISIONS:
        return f"precision {precision!r} is not one of {PRECISIONS}"
    if dtype == torch.float64 and precision != "fp32":
        return f"float64 takes precision 'fp32', not {precision!r}"
    if min(_block(F), _block(FO)) < 16:
        return f"F and F' must both be multiples of 16 (F = {F}, F' = {FO})"
    return None


def _why(precision):
    """:func:`why_not` of a call (its first rows and ``weight_out``)."""

    def why(x_cos, weight_out):
        if not isinstance(precision, str):
            return f"precision {precision!r} is not one of {PRECISIONS}"
        n_ang, FO, F = weight_out.shape
        return why_not(precision, x_cos.device.type, x_cos.dtype, F, FO)

    return why


def _checked(x_cos, weights, weight_out, precision, dtype):
    return _c.checked(x_cos, weights, weight_out, dtype, _why(precision), _WHO)


def _transposed(weights, weight_out, precision):
    """The layer kernels' backward weights: every W^T, W_out^T, in their form."""
    return _weights([w.transpose(1, 2) for w in (*weights, weight_out)], precision)


def _backward_buffers(like, n_ang, c, F, FO):
    """One cohort's planes for the backward, reused from cohort to cohort: the
    output gradient ``gp`` and two each of ``du`` and ``dz``."""
    gp = like.new_empty((n_ang, 2, c, FO))
    du = [like.new_empty((n_ang, 2, c, F)) for _ in range(2)]
    dz = [like.new_empty((n_ang, 2, c, F)) for _ in range(2)]
    return gp, du, dz


def stack_forward(x_cos, x_sin, weights, biases, weight_out, bias_out,
                  precision: str = "fp32", cohort_edges: int = COHORT_EDGES,
                  tiles=None, keep: bool = True, sin0_zero: bool = False):  # fmt: skip
    """``(y_cos, y_sin, z)`` of the stack on rows ``(E, F, n_ang)`` (any strides);
    ``z (K, n_ang, 2, E, F)`` the pre-activations (None unless ``keep``). The rows
    go through in cohorts of at most ``cohort_edges``, each copied into planes and
    back (rows that are a planes pair: read in place, and y handed out as one).
    ``precision``: :data:`~ecekern.cohorts.PRECISIONS`. ``tiles``: ``(BE, BN, BK,
    warps, stages)`` instead of :data:`~ecekern.stack_layers.kernels.TILES`.
    ``sin0_zero``: ``x_sin[..., 0]`` is taken as zero (not read), so that the m = 0
    sin part of every layer is zero and skipped: ``y_sin[..., 0] = 0``, and the
    m = 0 sin planes of z, ``z[:, 0, 1]``, are not written (they would be zero; no
    backward reads them). A ValueError where the kernels cannot serve the call
    (:func:`why_not`)."""
    _c.flags(keep=keep, sin0_zero=sin0_zero)
    if not isinstance(x_cos, torch.Tensor):
        raise TypeError(f"x_cos must be an (E, F, n_ang) tensor, got {x_cos!r:.60}")
    E, dev, dt = x_cos.shape[0], x_cos.device, x_cos.dtype
    K = len(weights)
    n_ang, FO, F = _checked(x_cos, weights, weight_out, precision, dt)
    _c.check_rows(E, F, n_ang, dev, dt, x_cos=x_cos, x_sin=x_sin)
    _c.check_biases(biases, bias_out, K, F, FO, dev, dt)
    prec = kernel_precision(precision)
    z = x_cos.new_empty((K, n_ang, 2, E, F)) if keep else None
    xp, yP, y_cos, y_sin = _c.out_layout(x_cos, x_sin, E, FO, n_ang)
    spans = _c.cohort_spans(E, cohort_edges)
    if not spans:
        return y_cos, y_sin, z
    c = spans[0][1]
    ws = _weights((*weights, weight_out), prec)
    bs = [None if b is None else b.contiguous() for b in (*biases, bias_out)]
    u = [x_cos.new_empty((n_ang, 2, c, F)) for _ in range(2)]
    yp = x_cos.new_empty((n_ang, 2, c, FO)) if xp is None else None
    for a, b in spans:
        n = b - a
        src = _c.rows_in(xp, a, b, u[0], x_cos, x_sin, sin0_zero)
        dst = yP[:, :, a:b] if xp is not None else yp[:, :, :n]
        zk = z[:, :, :, a:b] if keep else None
        _forward_cohort(src, n, zk, ws, bs, u, dst, F, FO, n_ang, prec, tiles, dt,
                        keep, sin0_zero)  # fmt: skip
        if xp is None:
            _c.rows_out(yp, n, y_cos[a:b], y_sin[a:b], sin0_zero)
    if xp is not None and sin0_zero:
        yP[0, 1].zero_()  # the m = 0 sin plane the kernels skip
    return y_cos, y_sin, z


def _backward_setup(g_cos, g_sin, weights, weight_out, precision, dt, E):
    return _c.backward_setup(g_cos, g_sin, weights, weight_out, precision, dt, E,
                             _checked)  # fmt: skip


def stack_backward(z, g_cos, g_sin, weights, weight_out, precision: str = "fp32",
                   cohort_edges: int = COHORT_EDGES, tiles=None,
                   sin0_zero: bool = False):  # fmt: skip
    """``(dx_cos, dx_sin)``, each ``(E, F, n_ang)``, of the stack for the output
    gradient ``g (E, F', n_ang)`` (any strides), from the pre-activations ``z`` that
    :func:`stack_forward` kept (no parameter gradients); in cohorts as there. With
    ``sin0_zero`` (as the forward had it), ``g_sin[..., 0]`` is not read and
    ``dx_sin[..., 0] = 0``."""
    _c.flags(sin0_zero=sin0_zero)
    K = len(weights)
    _c.check_z(z, g_cos, K)
    E, dev, dt = g_cos.shape[0], g_cos.device, g_cos.dtype
    n_ang, FO, F = _backward_setup(g_cos, g_sin, weights, weight_out, precision, dt,
                                   E)  # fmt: skip
    prec = kernel_precision(precision)
    _c.check_kept_z(z, K, n_ang, E, F, dev)
    gP, dxP, dx_cos, dx_sin = _c.out_layout(g_cos, g_sin, E, F, n_ang)
    spans = _c.cohort_spans(E, cohort_edges)
    if not spans:
        return dx_cos, dx_sin
    c = spans[0][1]
    wt = _transposed(weights, weight_out, prec)
    gp, du, dz = _backward_buffers(dx_cos, n_ang, c, F, FO)
    for a, b in spans:
        n = b - a
        src = _c.rows_in(gP, a, b, gp, g_cos, g_sin, sin0_zero)
        final = dxP[:, :, a:b] if dxP is not None else None
        res = _backward_cohort(src, n, z[:, :, :, a:b], wt, du, dz, F, FO, n_ang,
                               prec, tiles, dt, sin0_zero, final)  # fmt: skip
        if dxP is None:
            _c.rows_out(res, n, dx_cos[a:b], dx_sin[a:b], sin0_zero)
    if dxP is not None and sin0_zero:
        dxP[0, 1].zero_()  # the m = 0 sin plane the kernels skip
    return dx_cos, dx_sin


def stack_recompute_backward(x_cos, x_sin, g_cos, g_sin, weights, biases,
                             weight_out, precision: str = "fp32",
                             cohort_edges: int = COHORT_EDGES, tiles=None,
                             sin0_zero: bool = False):  # fmt: skip
    """``(dx_cos, dx_sin)`` as :func:`stack_backward`, from the stack's input x
    (``(E, F, n_ang)``, any strides) instead of a kept z: each cohort's gated
    layers run forward again into a cohort's z, then its backward. ``biases``: the
    K gated layers' (the output layer's bias plays no part in dx). With
    ``sin0_zero`` (as the forward had it), ``x_sin[..., 0]`` and ``g_sin[..., 0]``
    are not read and ``dx_sin[..., 0] = 0``. Nothing of size E but x, g and dx: the
    scratch is about ``(K + 5) 2 c F n_ang`` values for ``c = cohort_edges``; the
    price is one more forward of the gated layers."""
    _c.flags(sin0_zero=sin0_zero)
    for name, t in (("x_cos", x_cos), ("g_cos", g_cos)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be an (E, width, n_ang) tensor, got "
                            f"{t!r:.60}")  # fmt: skip
    E, dev, dt = x_cos.shape[0], x_cos.device, x_cos.dtype
    K = len(weights)
    n_ang, FO, F = _backward_setup(g_cos, g_sin, weights, weight_out, precision, dt,
                                   E)  # fmt: skip
    prec = kernel_precision(precision)
    _c.check_rows(E, F, n_ang, dev, dt, x_cos=x_cos, x_sin=x_sin)
    _c.check_biases(biases, None, K, F, FO, dev, dt)
    gP, dxP, dx_cos, dx_sin = _c.out_layout(g_cos, g_sin, E, F, n_ang)
    spans = _c.cohort_spans(E, cohort_edges)
    if not spans:
        return dx_cos, dx_sin
    c = spans[0][1]
    xp = _c.as_planes(x_cos, x_sin)
    zc = x_cos.new_empty((K, n_ang, 2, c, F))
    ws = _weights(weights, prec)
    wt = _transposed(weights, weight_out, prec)
    bs = [None if b is None else b.contiguous() for b in biases]
    gp, du, dz = _backward_buffers(x_cos, n_ang, c, F, FO)
    for a, b in spans:
        n = b - a
        xs = _c.rows_in(xp, a, b, du[0], x_cos, x_sin, sin0_zero)
        zk = zc[:, :, :, :n]  # the gated layers only (z_1 .. z_K), through dz
        _forward_cohort(xs, n, zk, ws, [*bs, None], dz, None, F, FO, n_ang, prec,
                        tiles, dt, True, sin0_zero)  # fmt: skip
        src = _c.rows_in(gP, a, b, gp, g_cos, g_sin, sin0_zero)
        final = dxP[:, :, a:b] if dxP is not None else None
        res = _backward_cohort(src, n, zk, wt, du, dz, F, FO, n_ang, prec, tiles,
                               dt, sin0_zero, final)  # fmt: skip
        if dxP is None:
            _c.rows_out(res, n, dx_cos[a:b], dx_sin[a:b], sin0_zero)
    if dxP is not None and sin0_zero:
        dxP[0, 1].zero_()  # the m = 0 sin plane the kernels skip
    return dx_cos, dx_sin
