"""The whole mixing stack in one kernel per tile of edges, the tile on chip: forward,
and the force backward, on the tensor cores (Gluon, Hopper ``wgmma``) or, in strict
fp32, on the FMA units; launched over cohorts of edges.

Formula (:func:`ecekern.reference.mixing_stack`; per edge e, order m, cos and sin
alike)::

    u_0 = x;  z_k = W_k[m] u_(k-1) (+ b_k at m = 0, cos);  u_k = u_(k-1) + gate(z_k)
    y = W_out[m] u_K (+ b_out at m = 0, cos)
    du_K = W_out[m]^T dy;  dz_k = gate'(z_k) du_k;  du_(k-1) = du_k + W_k[m]^T dz_k
    dx = du_0

A program owns a tile of 32 edges at a time, its state in shared memory through
every layer, the weights streamed from L2 through a ring (:mod:`.ring`); the
forward kernel (:mod:`.forward_kernel`) keeps z or, without one, writes only y; the
backward kernel (:mod:`.backward_kernel`) runs from the kept z or makes each tile's z
again from x on chip (:func:`stack_recompute_backward`). :mod:`.launch` launches
them on a cohort's planes; the functions here run the cohorts.

Shapes: rows ``x_cos, x_sin, dx (E, F, n_ang)``, ``y, dy (E, F', n_ang)``, any
strides; ``W_k (n_ang, F, F)``, ``W_out (n_ang, F', F)``; ``z (K, n_ang, 2, E, F)``.
The kernels are written for n_ang = 3, F = 192, F' = 96 (``ring.F_IN``, ``F_OUT``,
``N_ANG``). Rows that are a planes pair (chapter 3's ``planes=True``) are read in
place and y, dx handed out as planes pairs; other rows are copied into planes
buffers a cohort at a time, and back.

Bytes (DRAM), in activations of ``2 E F n_ang`` values (cos and sin): the forward
reads x and writes y and z (five of the six planes of each z_k),
``1 + F'/F + 5 K / 6``; the backward reads dy and z and writes dx, the same. At
K = 2, F' = F/2 that is 3.2 each way (2.9 with ``sin0``), against the layer
kernels' 6.3 and 9.6 (with ``sin0``). Recomputing: the forward reads x and
writes y (``1 + F'/F``, 1.25 with ``sin0``), the backward reads x and dy and
writes dx (``2 + F'/F``, 2.1 with ``sin0``), and z of a tile, ``K 5/6``
activations of 32 edges, goes to L2 and back. L2: all the weights, once a tile
each way, twice in the recomputing backward (twice that in 3xTF32: the TF32 part
and the remainder; half in bf16). Copying rows that are not planes pairs adds
``2 (1 + F'/F)`` each way.
FLOPs: ``4 n_ang (K F^2 + F' F) E`` each way, the m = 0 sin rows included, and
``4 n_ang K F^2 E`` more in the recomputing backward; three times that on the
tensor cores in 3xTF32.

Precision (``precision``, :data:`~ecekern.cohorts.PRECISIONS`), float32 rows only:
``"fp32"`` (strict fp32 FMAs; the backward chunked as 3xTF32, the forward's sums from
zero in one chunk), ``"tf32"``, fp32-accurate ``"3xtf32"``, or ``"bf16"`` (rows rounded
to bf16 in registers and W once a call; fp32 sums).

Gradients: these are the gradients (the backward kernel); no parameter gradients
(:func:`ecekern.cohorts.mixing_stack` computes those by recomputing cohorts).

Status: n_ang = 3, F = 192, F' = 96, CUDA with validated Gluon (sm_90);
:func:`ecekern.cohorts.mixing_stack` with ``kernels="fused"`` (with ``recompute``:
y only, and the recomputing backward); compiles for sm_90 without a GPU (tests);
its GPU tests compare it with the fp64 reference by the three-way rule at its
precision, both ways.
"""

from __future__ import annotations

import functools

import torch

from .. import _stack_common as _c
from .._stack_common import COHORT_EDGES, PRECISIONS, kernel_precision
from .._triton import GLUON_REASON, gluon
from .launch import backward, forward
from .ring import F_IN, F_OUT, N_ANG, backward_weights, forward_weights

__all__ = [
    "PRECISIONS",
    "stack_backward",
    "stack_forward",
    "stack_recompute_backward",
    "why_not",
]

_WHO = "the fused stack"


@functools.lru_cache(maxsize=64)
def why_not(precision: str, device_type: str, capability: tuple | None, dtype,
            F: int, FO: int, n_ang: int) -> str | None:  # fmt: skip
    """Why the fused kernels cannot serve a stack of this shape in ``precision``
    (:data:`~ecekern.cohorts.PRECISIONS`) on ``device_type`` rows of ``dtype``, or None
    (cached); ``capability``: the CUDA device's ``(major, minor)`` (None: not known; the
    kernels are Hopper's, sm_90)."""
    if device_type != "cuda":
        return "not a CUDA tensor"
    if capability is not None and tuple(capability)[0] != 9:
        major, minor = tuple(capability)[:2]
        return (f"sm_{major}{minor} is not Hopper: the fused stack's TMA (and "
                "wgmma) kernels are sm_90's")  # fmt: skip
    if gluon is None:
        return GLUON_REASON or "no Gluon in this Triton"
    if dtype != torch.float32 or precision not in PRECISIONS:
        return (f"{dtype} in {precision!r}: the fused stack is float32 in "
                f"{' or '.join(map(repr, PRECISIONS))}")  # fmt: skip
    if (F, FO, n_ang) != (F_IN, F_OUT, N_ANG):
        return (f"F = {F}, F' = {FO}, n_ang = {n_ang}: the fused stack is written for "
                f"{F_IN}, {F_OUT}, {N_ANG}")  # fmt: skip
    return None


def _checked(x_cos, weights, weight_out, precision, dtype):
    """The launchers' shared checks, with :func:`why_not` for the call."""

    def why(x, wo):
        n_ang, FO, F = wo.shape
        cap = torch.cuda.get_device_capability(x.device) if x.is_cuda else None
        return why_not(precision, x.device.type, cap, x.dtype, F, FO, n_ang)

    return _c.checked(x_cos, weights, weight_out, dtype, why, _WHO)


def _buffers(like, n_ang, c, F, FO, rows_in: bool, rows_out: bool):
    """The backward's cohort buffers, only those a call needs: the output
    gradient's planes ``gp`` (for rows copied in), and one ``du`` (for dx rows
    copied out, or the recomputed forward's x rows copied in)."""
    gp = like.new_empty((n_ang, 2, c, FO)) if rows_in else None
    du = like.new_empty((n_ang, 2, c, F)) if rows_out else None
    return gp, du


def stack_forward(x_cos, x_sin, weights, biases, weight_out, bias_out,
                  precision: str = "fp32", cohort_edges: int = COHORT_EDGES,
                  keep: bool = True, sin0_zero: bool = False):  # fmt: skip
    """``(y_cos, y_sin, z)`` of the stack on rows ``(E, F, n_ang)`` (any strides),
    in cohorts of at most ``cohort_edges`` rows; ``z (K, n_ang, 2, E, F)`` the
    pre-activations, or None without ``keep`` (then the kernel writes only y).
    ``sin0_zero``: ``x_sin[..., 0]`` is taken as zero (not read), ``y_sin[..., 0]
    = 0``, and z's m = 0 sin planes are not written (no backward reads them). A
    ValueError where the kernels cannot serve the call (:func:`why_not`)."""
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
    prep = forward_weights(weights, biases, weight_out, bias_out, prec)
    u = x_cos.new_empty((n_ang, 2, c, F)) if xp is None else None  # x copied in
    yp = x_cos.new_empty((n_ang, 2, c, FO)) if xp is None else None
    for a, b in spans:
        n = b - a
        src = _c.rows_in(xp, a, b, u, x_cos, x_sin, sin0_zero)
        dst = yP[:, :, a:b] if xp is not None else yp[:, :, :n]
        forward(src, prep, z[:, :, :, a:b] if keep else None, dst, sin0_zero)
        if xp is None:
            _c.rows_out(yp, n, y_cos[a:b], y_sin[a:b], sin0_zero)
    if xp is not None and sin0_zero:
        yP[0, 1].zero_()  # the m = 0 sin plane the kernels skip
    return y_cos, y_sin, z


def _backward_setup(g_cos, g_sin, weights, weight_out, precision, dt, E):
    return _c.backward_setup(g_cos, g_sin, weights, weight_out, precision, dt, E,
                             _checked)  # fmt: skip


def stack_backward(z, g_cos, g_sin, weights, weight_out, precision: str = "fp32",
                   cohort_edges: int = COHORT_EDGES,
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
    prep = backward_weights(weights, weight_out, prec)
    gp, du = _buffers(dx_cos, n_ang, c, F, FO, gP is None, dxP is None)
    for a, b in spans:
        n = b - a
        src = _c.rows_in(gP, a, b, gp, g_cos, g_sin, sin0_zero)
        res = dxP[:, :, a:b] if dxP is not None else du[:, :, :n]
        backward(src, prep, z[:, :, :, a:b], res, sin0_zero)
        if dxP is None:
            _c.rows_out(res, n, dx_cos[a:b], dx_sin[a:b], sin0_zero)
    if dxP is not None and sin0_zero:
        dxP[0, 1].zero_()  # the m = 0 sin plane the kernels skip
    return dx_cos, dx_sin


def stack_recompute_backward(x_cos, x_sin, g_cos, g_sin, weights, biases,
                             weight_out, precision: str = "fp32",
                             cohort_edges: int = COHORT_EDGES,
                             sin0_zero: bool = False):  # fmt: skip
    """``(dx_cos, dx_sin)`` as :func:`stack_backward`, from the stack's input x
    (``(E, F, n_ang)``, any strides) instead of a kept z: one kernel makes each
    tile's z again on chip (through L2: each program's slab of z, ``6 K 32 F``
    values), then runs its backward; no z of the cohort. ``biases``: the K gated
    layers' (the output layer's bias plays no part in dx). With ``sin0_zero`` (as
    the forward had it), ``x_sin[..., 0]`` and ``g_sin[..., 0]`` are not read and
    ``dx_sin[..., 0] = 0``. Scratch: at most ``2 (1 + F'/F) c F n_ang`` values for
    ``c = cohort_edges``, only for rows that are not planes pairs; the price is one
    more forward of the gated layers."""
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
    prep = backward_weights(weights, weight_out, prec, biases)
    gp, du = _buffers(x_cos, n_ang, c, F, FO, gP is None, xp is None or dxP is None)
    for a, b in spans:
        n = b - a
        xs = _c.rows_in(xp, a, b, du, x_cos, x_sin, sin0_zero)
        src = _c.rows_in(gP, a, b, gp, g_cos, g_sin, sin0_zero)
        # (dx may go where x came in: a tile reads its x before it writes its dx)
        res = dxP[:, :, a:b] if dxP is not None else du[:, :, :n]
        backward(src, prep, None, res, sin0_zero, xs)
        if dxP is None:
            _c.rows_out(res, n, dx_cos[a:b], dx_sin[a:b], sin0_zero)
    if dxP is not None and sin0_zero:
        dxP[0, 1].zero_()  # the m = 0 sin plane the kernels skip
    return dx_cos, dx_sin
