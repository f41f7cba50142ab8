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
layers run forward again into a cohort-sized z before its backward (the fused
stack: each tile's, on chip, in its backward kernel). With
``sin0_zero`` the m = 0 sin column of x is taken as zero (the m = 0 order has no
sin part); that plane then stays zero through every layer, and the kernels skip it
(``SIN0``): ``2 n_ang - 1`` products a layer instead of ``2 n_ang`` (five instead
of six at n_ang = 3), ``y_sin[..., 0] = 0`` and ``dx_sin[..., 0] = 0``.

One kernel per layer each way (:mod:`.layer_kernels`), over cohorts of at most
``cohort_edges`` rows whose planes buffers are reused.

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

Precision (``KERNELS``; the names in ``STACKS``, ``"ieee-stack"`` ..
``"bf16-stack"``, hand the call to the fused stack, :mod:`.fused`): ``"ieee"``
(strict fp32 FMA, and float64),
``"tf32"``, ``"tf32x3"`` (fp32-accurate: ``hi lo + lo hi + hi hi`` in three TF32
products, W split once a call by :func:`split_tf32`, the rows split in registers,
each inner chunk summed from zero and added to the accumulator in fp32) and
``"bf16"`` (operands rounded to bfloat16, fp32 accumulation), for float32 rows.
Triton's CPU interpreter computes TF32 products in full precision (``"tf32x3"``
then lacks only lo lo).

Gradients: these are the gradients (the backward kernels); no parameter gradients
(:func:`ecekern.cohorts.mixing_stack` computes those by recomputing cohorts).

Status: tested against the reference in float64 (Triton's CPU interpreter) and
float32 (the H200); the default force step's stack for float32 on CUDA, in 3xTF32
(option ``cohort_fused``). DRAM- and latency-bound: about twice the bytes model
in TF32 (chapter 6's Nsight captures).
"""

from __future__ import annotations

import functools

import torch

from .. import options
from .._triton import why_not_triton
from . import fused as _fused
from .layer_kernels import (
    _backward_cohort,
    _block,
    _forward_cohort,
    _weights,
    split_tf32,
)
from .planes import (
    _as_planes,
    _backward_buffers,
    _cohorts,
    _grad_layouts,
    _out,
    _planes_pair,
    _rows_in,
)

__all__ = [
    "KERNELS",
    "PRECISIONS",
    "STACKS",
    "stack_backward",
    "stack_forward",
    "split_tf32",
    "stack_recompute_backward",
    "why_not_layers",
]

#: Precisions of the products: ``tl.dot``'s input precisions, and bf16 operands.
PRECISIONS = ("ieee", "tf32", "tf32x3", "bf16")
#: The whole stack in one kernel per tile of edges (:mod:`.fused`), by the precision
#: of its products; where it cannot serve a call, the layer kernels at that precision
#: do, with a warning.
STACKS = {
    "ieee-stack": "ieee",
    "tf32x3-stack": "tf32x3",
    "tf32-stack": "tf32",
    "bf16-stack": "bf16",
}
KERNELS = (*PRECISIONS, *STACKS)
#: Rows a cohort: the planes buffers hold this many edges.
COHORT_EDGES = 65536


# --------------------------------------------------------------------------------------
# dispatch, checks, and the stack over cohorts
# --------------------------------------------------------------------------------------
def why_not_layers(x_cos, weight_out, precision) -> str | None:
    """Why the kernels cannot serve a call, or None (resolved once per device type,
    dtype, precision and widths, then cached)."""
    if not isinstance(precision, str):
        return f"precision {precision!r} is not one of {KERNELS}"
    n_ang, FO, F = weight_out.shape
    return _why_not(x_cos.device.type, x_cos.dtype, precision, F, FO)


@functools.lru_cache(maxsize=64)
def _why_not(device_type: str, dtype, precision, F: int, FO: int) -> str | None:
    why = why_not_triton(device_type)
    if why:
        return why
    if dtype not in (torch.float32, torch.float64):
        return f"dtype {dtype} (float32 and float64 only)"
    if precision not in KERNELS:
        return f"precision {precision!r} is not one of {KERNELS}"
    if dtype == torch.float64 and precision != "ieee":
        return f"float64 takes precision 'ieee', not {precision!r}"
    if min(_block(F), _block(FO)) < 16:
        return f"F and F' must both be multiples of 16 (F = {F}, F' = {FO})"
    return None


@functools.lru_cache(maxsize=64)
def _why_not_stack(device_type: str, cap, dtype, F: int, FO: int, n_ang: int,
                   prec: str):  # fmt: skip
    return _fused.why_not_fused(F, FO, n_ang, dtype, device_type, prec, cap)


@functools.lru_cache(maxsize=16)
def _capability(dev) -> tuple | None:
    return torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None


def _resolve(precision: str, dev, dtype, F: int, FO: int, n_ang: int):
    """``(precision, stack)``: a fused stack's name (:data:`STACKS`) becomes its
    products' precision, with ``stack`` True where the fused kernels serve the
    call; where not, a warning says why (once) and the layer kernels run."""
    if precision not in STACKS:
        return precision, False
    prec = STACKS[precision]
    why = _why_not_stack(dev.type, _capability(dev), dtype, F, FO, n_ang, prec)
    if why:
        options.fallback(f"cohorts.layers[{precision}]", why, to="the layer kernels")
    return prec, why is None


def _check(name: str, t, shape: tuple, device) -> None:
    """A clear error where a shape or device would send a kernel out of bounds."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(
            f"{name} must be a tensor of shape {shape}, got {type(t).__name__}"
        )
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} is {tuple(t.shape)}, expected {shape}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the rows on {device}")


def _checked(x_cos, weights, weight_out, precision, dtype):
    """``(n_ang, F', F)`` after the checks every launcher shares (``x_cos``: the
    first rows, ``(E, width, n_ang)``)."""
    if not isinstance(weight_out, torch.Tensor) or weight_out.ndim != 3:
        raise ValueError("weight_out must be an (n_ang, F', F) tensor")
    if not isinstance(x_cos, torch.Tensor) or x_cos.ndim != 3:
        t = x_cos
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"the rows must be (E, width, n_ang) tensors, got {got}")
    if weight_out.shape[0] != x_cos.shape[-1]:
        n_w, n_x = weight_out.shape[0], x_cos.shape[-1]
        raise ValueError(f"weight_out has n_ang = {n_w}, the rows have {n_x}")
    if not isinstance(weights, (list, tuple)):
        raise TypeError(
            f"weights must be a list of tensors, got {type(weights).__name__}"
        )
    why = why_not_layers(x_cos, weight_out, precision)
    if why:
        raise ValueError(f"the layer kernels cannot serve this call: {why}")
    n_ang, FO, F = weight_out.shape
    named = [*((f"weights[{k}]", w) for k, w in enumerate(weights)),
             ("weight_out", weight_out)]  # fmt: skip
    for name, wt in named:
        shape = (n_ang, F if name != "weight_out" else FO, F)
        if isinstance(wt, torch.Tensor) and tuple(wt.shape) != shape:  # F: W_out's
            wo = tuple(weight_out.shape)
            raise ValueError(f"{name} is {tuple(wt.shape)}, expected {shape} "
                             f"(F = {F}, from weight_out {wo})")  # fmt: skip
        _check(name, wt, shape, x_cos.device)
        if wt.dtype != dtype:
            raise TypeError(f"{name} has dtype {wt.dtype} but the rows have {dtype}")
    return n_ang, FO, F


def _flags(**flags) -> None:
    """A TypeError for a flag that is not a bool (``sin0_zero=2`` would skip a
    plane the kernels then read)."""
    for name, v in flags.items():
        if not isinstance(v, bool):
            raise TypeError(f"{name} must be a bool, got {v!r}")


def _check_rows(E, F, n_ang, dev, dt, **rows):
    for name, t in rows.items():
        _check(name, t, (E, F, n_ang), dev)
        if t.dtype != dt:
            raise TypeError(f"{name} has dtype {t.dtype}, the weights {dt}")


def _check_biases(biases, bias_out, K, F, FO, dev, dt):
    if not isinstance(biases, (list, tuple)):
        raise TypeError(f"biases must be a list (a tensor or None each), got "
                        f"{type(biases).__name__}")  # fmt: skip
    if len(biases) != K:
        raise ValueError(f"{len(biases)} biases for {K} weights")
    named = [
        *((f"biases[{k}]", b) for k, b in enumerate(biases)),
        ("bias_out", bias_out),
    ]
    for k, (name, bk) in enumerate(named):
        if bk is not None:
            _check(name, bk, (F if k < K else FO,), dev)
            if bk.dtype != dt:
                raise TypeError(f"{name} has dtype {bk.dtype} but the rows have {dt}")


def stack_forward(x_cos, x_sin, weights, biases, weight_out, bias_out,
                  precision: str = "ieee", cohort_edges: int = COHORT_EDGES,
                  tiles=None, keep: bool = True, sin0_zero: bool = False):  # fmt: skip
    """``(y_cos, y_sin, z)`` of the stack on rows ``(E, F, n_ang)`` (any strides);
    ``z (K, n_ang, 2, E, F)`` the pre-activations (None unless ``keep``). The rows
    go through in cohorts of at most ``cohort_edges``, each copied into planes and
    back. ``tiles``: ``(BE, BN, BK, warps, stages)`` instead of
    :data:`~ecekern.cohorts.layer_kernels.TILES`.
    ``sin0_zero``: ``x_sin[..., 0]`` is taken as zero (not read), so that the m = 0
    sin part of every layer is zero and skipped: ``y_sin[..., 0] = 0``, and the
    m = 0 sin planes of z, ``z[:, 0, 1]``, are not written (they would be zero; no
    backward reads them). A fused stack without ``keep`` writes only y."""
    _flags(keep=keep, sin0_zero=sin0_zero)
    if not isinstance(x_cos, torch.Tensor):
        raise TypeError(f"x_cos must be an (E, F, n_ang) tensor, got {x_cos!r:.60}")
    E, dev, dt = x_cos.shape[0], x_cos.device, x_cos.dtype
    K = len(weights)
    n_ang, FO, F = _checked(x_cos, weights, weight_out, precision, dt)
    _check_rows(E, F, n_ang, dev, dt, x_cos=x_cos, x_sin=x_sin)
    _check_biases(biases, bias_out, K, F, FO, dev, dt)
    precision, stack = _resolve(precision, dev, dt, F, FO, n_ang)
    z = x_cos.new_empty((K, n_ang, 2, E, F)) if keep else None
    xp = _as_planes(x_cos, x_sin)  # planes in: no copies, and planes out
    if xp is not None:
        yP, y_cos, y_sin = _planes_pair(x_cos, E, FO, n_ang)
    else:
        y_cos = x_cos.new_empty((E, FO, n_ang))
        y_sin = torch.empty_like(y_cos)
    spans = _cohorts(E, cohort_edges)
    if not spans:
        return y_cos, y_sin, z
    c = spans[0][1]
    if stack:
        prep = _fused.forward_weights(weights, biases, weight_out, bias_out, precision)
    else:
        ws = _weights((*weights, weight_out), precision)
        bs = [None if b is None else b.contiguous() for b in (*biases, bias_out)]
    # the layer kernels' two u buffers; the fused stack's one for x's rows copied in
    n_u = 2 if not stack else int(xp is None)
    u = [x_cos.new_empty((n_ang, 2, c, F)) for _ in range(n_u)] or [None]
    yp = x_cos.new_empty((n_ang, 2, c, FO)) if xp is None else None
    for a, b in spans:
        n = b - a
        src = _rows_in(xp, a, b, u[0], x_cos, x_sin, sin0_zero)
        dst = yP[:, :, a:b] if xp is not None else yp[:, :, :n]
        zk = z[:, :, :, a:b] if keep else None
        if stack:
            _fused.forward(src, prep, zk, dst, sin0_zero)  # zk None: y only
        else:
            _forward_cohort(src, n, zk, ws, bs, u, dst, F, FO, n_ang, precision,
                            tiles, dt, keep, sin0_zero)  # fmt: skip
        if xp is None:
            _out(yp, n, y_cos[a:b], y_sin[a:b], sin0_zero)
    if xp is not None and sin0_zero:
        yP[0, 1].zero_()  # the m = 0 sin plane the kernels skip
    return y_cos, y_sin, z


def _backward_setup(g_cos, g_sin, weights, weight_out, precision, dt, E):
    n_ang, FO, F = _checked(g_cos, weights, weight_out, precision, dt)
    _check_rows(E, FO, n_ang, g_cos.device, dt, g_cos=g_cos, g_sin=g_sin)
    return n_ang, FO, F


def _transposed(weights, weight_out, precision):
    """The layer kernels' backward weights: every W^T, W_out^T, in their form."""
    return _weights([w.transpose(1, 2) for w in (*weights, weight_out)], precision)


def _fused_buffers(like, n_ang, c, F, FO, rows_in: bool, rows_out: bool):
    """The fused backward's cohort buffers, only those a call needs: the output
    gradient's planes ``gp`` (for rows copied in), and one ``du`` (for dx rows
    copied out, or the recomputed forward's x rows copied in)."""
    gp = like.new_empty((n_ang, 2, c, FO)) if rows_in else None
    du = like.new_empty((n_ang, 2, c, F)) if rows_out else None
    return gp, [du, du]


def stack_backward(z, g_cos, g_sin, weights, weight_out, precision: str = "ieee",
                   cohort_edges: int = COHORT_EDGES, tiles=None,
                   sin0_zero: bool = False):  # fmt: skip
    """``(dx_cos, dx_sin)``, each ``(E, F, n_ang)``, of the stack for the output
    gradient ``g (E, F', n_ang)`` (any strides), from the pre-activations ``z`` that
    :func:`stack_forward` kept (no parameter gradients); in cohorts as there. With
    ``sin0_zero`` (as the forward had it), ``g_sin[..., 0]`` is not read and
    ``dx_sin[..., 0] = 0``."""
    _flags(sin0_zero=sin0_zero)
    if not isinstance(z, torch.Tensor):
        raise TypeError("z must be the pre-activations stack_forward kept (keep=True),"
                        f" got {z!r:.60}")  # fmt: skip
    if not isinstance(g_cos, torch.Tensor):
        raise TypeError(f"g_cos must be an (E, F', n_ang) tensor, got {g_cos!r:.60}")
    E, dev, dt = g_cos.shape[0], g_cos.device, g_cos.dtype
    if z.dtype != dt:
        raise TypeError(f"z has dtype {z.dtype}, the output gradient {dt}")
    K = len(weights)
    if z.ndim == 5 and z.shape[0] != K:
        raise ValueError(f"z holds {z.shape[0]} layers' pre-activations, {K} weights")
    n_ang, FO, F = _backward_setup(g_cos, g_sin, weights, weight_out, precision, dt,
                                   E)  # fmt: skip
    precision, stack = _resolve(precision, dev, dt, F, FO, n_ang)
    _check("z", z, (K, n_ang, 2, E, F), dev)
    if not z.is_contiguous():
        raise ValueError("z must be contiguous, as stack_forward returns it")
    gP, dxP, dx_cos, dx_sin = _grad_layouts(g_cos, g_sin, E, F, n_ang)
    spans = _cohorts(E, cohort_edges)
    if not spans:
        return dx_cos, dx_sin
    c = spans[0][1]
    if stack:
        prep = _fused.backward_weights(weights, weight_out, precision)
        gp, du = _fused_buffers(dx_cos, n_ang, c, F, FO, gP is None, dxP is None)
    else:
        wt = _transposed(weights, weight_out, precision)
        gp, du, dz = _backward_buffers(dx_cos, n_ang, c, F, FO)
    for a, b in spans:
        n = b - a
        src = _rows_in(gP, a, b, gp, g_cos, g_sin, sin0_zero)
        final = dxP[:, :, a:b] if dxP is not None else None
        if stack:
            res = du[0][:, :, :n] if final is None else final
            _fused.backward(src, prep, z[:, :, :, a:b], res, sin0_zero)
        else:
            res = _backward_cohort(src, n, z[:, :, :, a:b], wt, du, dz, F, FO,
                                   n_ang, precision, tiles, dt, sin0_zero,
                                   final)  # fmt: skip
        if dxP is None:
            _out(res, n, dx_cos[a:b], dx_sin[a:b], sin0_zero)
    if dxP is not None and sin0_zero:
        dxP[0, 1].zero_()  # the m = 0 sin plane the kernels skip
    return dx_cos, dx_sin


def stack_recompute_backward(x_cos, x_sin, g_cos, g_sin, weights, biases,
                             weight_out, precision: str = "ieee",
                             cohort_edges: int = COHORT_EDGES, tiles=None,
                             sin0_zero: bool = False):  # fmt: skip
    """``(dx_cos, dx_sin)`` as :func:`stack_backward`, from the stack's input x
    (``(E, F, n_ang)``, any strides) instead of a kept z: each cohort's gated
    layers run forward again into a cohort's z, then its backward; a fused stack
    (:data:`STACKS`) runs both in one kernel, each tile's z in L2, no z of the
    cohort. ``biases``: the K gated layers' (the output layer's bias plays no part
    in dx). With ``sin0_zero`` (as the forward had it), ``x_sin[..., 0]`` and
    ``g_sin[..., 0]`` are not read and ``dx_sin[..., 0] = 0``. Nothing of size E
    but x, g and dx: the scratch is about ``(K + 5) 2 c F n_ang`` values for
    ``c = cohort_edges`` (for a fused stack at most ``2 (1 + F'/F) c F n_ang``,
    only for rows that are not planes, and each program's slab of z, ``6 K 32 F``
    values); the price is one more forward of the gated
    layers."""
    _flags(sin0_zero=sin0_zero)
    for name, t in (("x_cos", x_cos), ("g_cos", g_cos)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be an (E, width, n_ang) tensor, got "
                            f"{t!r:.60}")  # fmt: skip
    E, dev, dt = x_cos.shape[0], x_cos.device, x_cos.dtype
    K = len(weights)
    n_ang, FO, F = _backward_setup(g_cos, g_sin, weights, weight_out, precision, dt,
                                   E)  # fmt: skip
    precision, stack = _resolve(precision, dev, dt, F, FO, n_ang)
    _check_rows(E, F, n_ang, dev, dt, x_cos=x_cos, x_sin=x_sin)
    _check_biases(biases, None, K, F, FO, dev, dt)
    gP, dxP, dx_cos, dx_sin = _grad_layouts(g_cos, g_sin, E, F, n_ang)
    spans = _cohorts(E, cohort_edges)
    if not spans:
        return dx_cos, dx_sin
    c = spans[0][1]
    xp = _as_planes(x_cos, x_sin)
    if stack:  # one kernel: each tile's z made again on chip, then its backward
        prep = _fused.backward_weights(weights, weight_out, precision, biases)
        gp, du = _fused_buffers(x_cos, n_ang, c, F, FO, gP is None,
                                xp is None or dxP is None)  # fmt: skip
    else:
        zc = x_cos.new_empty((K, n_ang, 2, c, F))
        ws = _weights(weights, precision)
        wt = _transposed(weights, weight_out, precision)
        bs = [None if b is None else b.contiguous() for b in biases]
        gp, du, dz = _backward_buffers(x_cos, n_ang, c, F, FO)
    for a, b in spans:
        n = b - a
        xs = _rows_in(xp, a, b, du[0], x_cos, x_sin, sin0_zero)
        if not stack:  # the gated layers only (z_1 .. z_K), through the dz buffers
            zk = zc[:, :, :, :n]
            _forward_cohort(xs, n, zk, ws, [*bs, None], dz, None, F, FO, n_ang,
                            precision, tiles, dt, True, sin0_zero)  # fmt: skip
        src = _rows_in(gP, a, b, gp, g_cos, g_sin, sin0_zero)
        final = dxP[:, :, a:b] if dxP is not None else None
        if stack:  # (du[0] is du[1]: a tile reads its x before it writes its dx)
            res = du[1][:, :, :n] if final is None else final
            _fused.backward(src, prep, None, res, sin0_zero, xs)
        else:
            res = _backward_cohort(src, n, zk, wt, du, dz, F, FO, n_ang, precision,
                                   tiles, dt, sin0_zero, final)  # fmt: skip
        if dxP is None:
            _out(res, n, dx_cos[a:b], dx_sin[a:b], sin0_zero)
    if dxP is not None and sin0_zero:
        dxP[0, 1].zero_()  # the m = 0 sin plane the kernels skip
    return dx_cos, dx_sin
