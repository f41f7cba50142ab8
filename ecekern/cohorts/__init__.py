"""Edge cohorts (chapter 6): the mixing stack's backward, a cohort of edges at a time.

Formula (:func:`ecekern.reference.mixing_stack`), for each edge's row independently::

    u_0 = x;   u_k = u_(k-1) + gate(Linear_k(u_(k-1))),  k = 1..K;   y = Linear_out(u_K)

Shapes: ``x_cos, x_sin (..., F, n_ang)``; ``W_k (n_ang, F, F)``, ``b_k (F,)`` or None;
``W_out (n_ang, F', F)``, ``b_out (F',)`` or None; ``y_cos, y_sin (..., F', n_ang)``.
The leading dimensions are the edges, ``E`` rows in all.

Autograd through the plain stack keeps, for K = 2, about five activations of
``2 E F n_ang`` values (each linear's input, the gates' values and operands). Here the
forward runs cohort by cohort under ``no_grad`` and keeps ``x``, the parameters and
(by default) the pre-activations ``z_k``. Two backwards:

* a force step (no parameter gradient asked for), from the kept ``z_k``, a cohort of
  at most ``cohort_edges`` rows at a time::

      du_K = Linear_out^T(dy);   dz_k = gate'(z_k) du_k;
      du_(k-1) = du_k + Linear_k^T(dz_k),  k = K..1;   dx = du_0

  with ``Linear^T`` the same map with each ``W[m]`` transposed; no linear of the
  forward runs again;
* with ``recompute=True`` (only ``x`` kept), and for parameter gradients: each cohort's
  forward is run again with autograd and differentiated at once; parameter gradients
  are summed over the cohorts in order (deterministic).

Bytes model: kept for the backward, ``(K + 1) 2 E F n_ang`` values (``x`` and the
``z_k``), or ``2 E F n_ang`` with ``recompute``, each ``2 E F n_ang`` less when
``x_rebuild`` makes x again instead; scratch, one cohort's worth, about
``(3K + 2) 2 c F n_ang`` values for ``c = cohort_edges``, whatever E is. The price of
``recompute`` is one more forward of the stack in the backward.

Gradients: x, the weights and biases (skipped in a force step, which asks for the
positions only). A second derivative (training on forces) recomputes the whole stack
differentiably, at the plain stack's memory.

This is the memory strategy; the arithmetic of the forward and of a force step's
backward is ``linear``'s, or with ``kernels`` one of two kernel families at a
``precision``: ``"layers"``, :mod:`ecekern.stack_layers` (one Triton kernel per
layer, the gate and residual in its epilogue, z kept in one tensor), or
``"fused"``, :mod:`ecekern.stack_fused` (the whole stack in one Gluon kernel per
tile of edges, sm_90). Where the fused kernels cannot serve a call the layer
kernels do, and where those cannot the linears do, each time with a
:class:`~ecekern.options.FallbackWarning` (:func:`why_not` says why, before any
launch).

Status: PyTorch level, any device and any ``linear``; while ``torch.compile`` traces,
the plain stack of ``linear`` is traced (the compiler plans its own memory; with
``kernels``, announced as a fallback: :data:`COMPILED`). On by default for CUDA
tensors, with the layer kernels in 3xTF32 for float32 (chapter 6's H200 captures).
"""

from __future__ import annotations

import functools
import numbers as _numbers

import torch

from .. import _stack_common, options, reference, stack_fused, stack_layers
from .._autograd import engine_uses, grad_node

__all__ = ["COHORT_EDGES", "KERNELS", "PRECISIONS", "mixing_stack", "why_not"]

#: Rows (edges) per cohort unless told otherwise (one value for the strategy and
#: the kernels' cohort launchers, ``ecekern._stack_common.COHORT_EDGES``).
COHORT_EDGES = _stack_common.COHORT_EDGES
#: The precisions of the kernels' products as callers name them. ``"fp32"``
#: (strict fp32 FMA; also the name for float64 rows), ``"3xtf32"`` (fp32-accurate,
#: three TF32 products), ``"tf32"``, ``"bf16"`` (operands rounded to bfloat16, fp32
#: sums).
PRECISIONS = _stack_common.PRECISIONS
#: The kernel families that can run the stack's forward and force backward
#: (``kernels=None``: the linears).
KERNELS = ("layers", "fused")
_FAMILY = {"layers": stack_layers, "fused": stack_fused}
#: Why a call that ``torch.compile`` traces runs the plain stack: the kernels give
#: the input gradient only, and a compiled backward computes every parameter
#: gradient the graph can reach.
COMPILED = (
    "torch.compile traces the call: a compiled backward asks for every parameter "
    "gradient, which the stack kernels do not compute"
)


def _check_kernels(kernels, precision) -> None:
    """A ValueError for a ``kernels`` or ``precision`` that is not one."""
    if kernels is not None and (not isinstance(kernels, str) or kernels not in KERNELS):
        raise ValueError(f"kernels must be None or one of {KERNELS}, got {kernels!r}")
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")


def why_not(kernels: str | None, precision: str, device_type: str,
            capability: tuple | None, dtype, F: int, FO: int,
            n_ang: int) -> str | None:  # fmt: skip
    """Why ``kernels`` (:data:`KERNELS`, or None for the linears, which serve every
    call) at ``precision`` (:data:`PRECISIONS`) cannot serve a stack of widths
    ``F``, ``F'`` and ``n_ang`` orders on ``device_type`` rows of ``dtype``, or
    None; ``capability``: the CUDA device's ``(major, minor)``, or None. Cached: a
    step plan asks once. A ValueError for an unknown ``kernels`` or
    ``precision``."""
    _check_kernels(kernels, precision)
    cap = None if capability is None else tuple(capability)
    return _why_not(kernels, precision, device_type, cap, dtype, F, FO, n_ang)


@functools.lru_cache(maxsize=128)
def _why_not(kernels, precision, device_type, capability, dtype, F, FO, n_ang):
    if kernels == "fused":
        return stack_fused.why_not(precision, device_type, capability, dtype, F, FO,
                                   n_ang)  # fmt: skip
    if kernels == "layers":
        return stack_layers.why_not(precision, device_type, dtype, F, FO)
    return None


@functools.lru_cache(maxsize=16)
def _capability(dev) -> tuple | None:
    return torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None


def _serving(kernels, precision, x, FO: int):
    """The kernels that serve a call on rows ``x (E, F, n_ang)``: ``kernels``, or
    where they cannot, the layer kernels (for the fused stack) or the linears
    (None), each step announced (:func:`ecekern.options.fallback`)."""
    if kernels is None:
        return None
    (F, n_ang), dev = x.shape[-2:], x.device
    args = (precision, dev.type, _capability(dev), x.dtype, F, FO, n_ang)
    why = why_not(kernels, *args)
    if why and kernels == "fused":
        options.fallback(f"cohorts.mixing_stack[fused {precision}]", why,
                         to="the layer kernels")  # fmt: skip
        kernels, why = "layers", why_not("layers", *args)
    if why:
        options.fallback(f"cohorts.mixing_stack[{kernels} {precision}]", why,
                         to="the linears")  # fmt: skip
        return None
    return kernels


def _stack(x_cos, x_sin, params, K, linear):
    weights, biases = params[:K], params[K : 2 * K]
    return reference.mixing_stack(
        x_cos, x_sin, list(weights), list(biases), params[2 * K], params[2 * K + 1],
        linear,
    )  # fmt: skip


def _stack_keep(x_cos, x_sin, params, K, linear):
    """The stack on one cohort, also returning the gated layers' pre-activations."""
    u_cos, u_sin, zs = x_cos, x_sin, []
    for k in range(K):
        z_cos, z_sin = linear(u_cos, u_sin, params[k], params[K + k])
        g_cos, g_sin = reference.gate(z_cos, z_sin)
        u_cos, u_sin = u_cos + g_cos, u_sin + g_sin
        zs += [z_cos, z_sin]
    return (*linear(u_cos, u_sin, params[2 * K], params[2 * K + 1]), *zs)


def _forward(x_cos, x_sin, params, K, linear, cohort, keep, kern=None):
    """The stack on ``(E, F, n_ang)`` rows, a cohort at a time, into one output:
    ``(y_cos, y_sin)``, followed with ``keep`` by ``z_k`` cos and sin, k = 1..K;
    ``kern``: None, or ``(family, precision, sin0)`` for a kernel family's
    ``stack_forward``, followed with ``keep`` by its one ``z (K, n_ang, 2, E, F)``
    (``sin0``: the m = 0 sin part skipped)."""
    if kern is not None:
        family, precision, sin0 = kern
        w, b = params[:K], params[K : 2 * K]
        y_cos, y_sin, z = family.stack_forward(
            x_cos, x_sin, w, b, params[2 * K], params[2 * K + 1], precision, cohort,
            keep=keep, sin0_zero=sin0,
        )  # fmt: skip
        return (y_cos, y_sin, z) if keep else (y_cos, y_sin)
    E = x_cos.shape[0]
    run = _stack_keep if keep else _stack
    if E <= cohort:
        return tuple(run(x_cos, x_sin, params, K, linear))
    out = None
    for a in range(0, E, cohort):
        b = min(a + cohort, E)
        got = run(x_cos[a:b], x_sin[a:b], params, K, linear)
        if out is None:
            out = tuple(t.new_empty((E, *t.shape[1:])) for t in got)
        for o, t in zip(out, got, strict=True):
            o[a:b] = t
    return out


def _zeroed(x_sin):
    """``x_sin`` with its m = 0 column zero, out of place and differentiably (its
    gradient there is zero)."""
    return torch.nn.functional.pad(x_sin[..., 1:], (1, 0))


def _gate_backward(z_cos, z_sin, du_cos, du_sin):
    """``dz`` of :func:`ecekern.reference.gate` at ``z`` for the output gradient
    ``du``: with ``p = z_cos[..., 0]`` and ``s = sigmoid(p)``, ``dz_m = du_m s``
    (m >= 1, cos and sin), ``dz_sin[..., 0] = du_sin[..., 0]`` and
    ``dz_cos[..., 0] = du_cos[..., 0] s + (du_cos[..., 0] p + sum_(m>=1) du_m z_m)
    s (1 - s)``."""
    p = z_cos[..., :1]
    s = torch.sigmoid(p)
    dz_cos, dz_sin = du_cos * s, du_sin * s
    dz_sin[..., :1] = du_sin[..., :1]
    t = (du_cos[..., 1:] * z_cos[..., 1:] + du_sin[..., 1:] * z_sin[..., 1:]).sum(
        -1, keepdim=True
    )
    dz_cos[..., :1] += (du_cos[..., :1] * p + t) * (s * (1 - s))
    return dz_cos, dz_sin


def _input_backward(zs, g_cos, g_sin, params, K, linear, cohort):
    """``dx`` from the kept pre-activations, a cohort at a time: ``du_K =
    Linear_out^T(dy)``; ``dz_k = gate'(z_k) du_k``; ``du_(k-1) = du_k +
    Linear_k^T(dz_k)``; ``dx = du_0``. No linear of the forward runs again."""
    E = g_cos.shape[0]
    F = params[2 * K].shape[-1]  # W_out (n_ang, F', F)
    dx_cos = g_cos.new_empty((E, F, g_cos.shape[-1]))
    dx_sin = torch.empty_like(dx_cos)

    def lin_t(a_cos, a_sin, w):  # x W^T: the same map with W's rows and columns swapped
        return linear(a_cos, a_sin, w.transpose(1, 2), None)

    for a in range(0, E, cohort):
        b = min(a + cohort, E)
        du_cos, du_sin = lin_t(g_cos[a:b], g_sin[a:b], params[2 * K])
        for k in reversed(range(K)):
            dz_cos, dz_sin = _gate_backward(
                zs[2 * k][a:b], zs[2 * k + 1][a:b], du_cos, du_sin
            )
            d_cos, d_sin = lin_t(dz_cos, dz_sin, params[k])
            du_cos, du_sin = du_cos + d_cos, du_sin + d_sin
        dx_cos[a:b], dx_sin[a:b] = du_cos, du_sin
    return dx_cos, dx_sin


def _cohort_backward(x_cos, x_sin, params, g_cos, g_sin, K, linear, cohort, need_x,
                     want):  # fmt: skip
    """dx row by row of cohorts, parameter gradients summed over cohorts in order."""
    E = x_cos.shape[0]
    dx_cos = torch.empty_like(x_cos) if need_x else None
    dx_sin = torch.empty_like(x_sin) if need_x else None
    grads_p: list = [None] * len(params)
    for a in range(0, E, cohort):
        b = min(a + cohort, E)
        with torch.enable_grad():
            xc = x_cos[a:b].detach().requires_grad_(need_x)
            xs = x_sin[a:b].detach().requires_grad_(need_x)
            y = _stack(xc, xs, params, K, linear)
            gy = (g_cos[a:b], g_sin[a:b])  # autograd materialises unused ones as zeros
            inputs = ([xc, xs] if need_x else []) + [params[i] for i in want]
            if not inputs:
                break
            got = torch.autograd.grad(y, inputs, gy, allow_unused=True)
        if need_x:
            dx_cos[a:b] = 0 if got[0] is None else got[0]
            dx_sin[a:b] = 0 if got[1] is None else got[1]
        for i, g in zip(want, got[2 if need_x else 0 :], strict=True):
            if g is not None:
                grads_p[i] = g if grads_p[i] is None else grads_p[i] + g
    for i in want:  # E = 0, or a parameter the stack does not use
        if grads_p[i] is None:
            grads_p[i] = torch.zeros_like(params[i])
    return dx_cos, dx_sin, grads_p


class _CohortStack(torch.autograd.Function):
    """``(x_cos, x_sin, linear, cohort, recompute, kern, remake, K, *params) ->
    (y_cos, y_sin)``, rows ``(E, F, n_ang)``; params = K weights, K biases, the
    output weight and bias. Saved: x (unless ``remake`` makes it again), the params
    and, unless ``recompute``, the pre-activations z_k. ``kern``: None, or
    ``(family, precision, sin0)`` for a kernel family (:mod:`ecekern.stack_layers`
    or :mod:`ecekern.stack_fused`); with ``sin0`` the m = 0 sin column of x is taken
    as zero (the kernels skip it, the other paths of the backward zero it:
    :func:`mixing_stack`'s ``sin0_zero``)."""

    @staticmethod
    def forward(ctx, x_cos, x_sin, linear, cohort, recompute, kern, remake, K,
                *params):  # fmt: skip
        keep = not recompute
        y_cos, y_sin, *zs = _forward(x_cos, x_sin, params, K, linear, cohort, keep,
                                     kern)  # fmt: skip
        xs = (x_cos, x_sin) if remake is None else ()
        ctx.save_for_backward(*xs, *params, *zs)
        ctx.linear, ctx.cohort, ctx.K, ctx.n_params = linear, cohort, K, len(params)
        ctx.kern, ctx.sin0, ctx.remake = kern, kern is not None and kern[2], remake
        ctx.x_meta = (x_cos.shape, x_cos.dtype, x_cos.device)
        ctx.nodes = [None if p is None else grad_node(p) for p in params]
        return y_cos, y_sin

    @staticmethod
    def _rows(ctx, saved):
        """x as the forward had it: kept, or made again by ``remake`` (checked)."""
        if ctx.remake is None:
            return saved[0], saved[1]
        x_cos, x_sin = ctx.remake()
        if torch.is_grad_enabled():  # a second derivative differentiates at x
            x_cos, x_sin = (t if t.requires_grad else t.detach().requires_grad_()
                            for t in (x_cos, x_sin))  # fmt: skip
        for name, t in (("x_cos", x_cos), ("x_sin", x_sin)):
            if (t.shape, t.dtype, t.device) != ctx.x_meta:
                raise RuntimeError(
                    f"x_rebuild made {name} {tuple(t.shape)} {t.dtype} on {t.device}; "
                    f"the forward's was {tuple(ctx.x_meta[0])} {ctx.x_meta[1]} on "
                    f"{ctx.x_meta[2]}"
                )
        return x_cos, x_sin

    @staticmethod
    def backward(ctx, g_cos, g_sin):
        saved = ctx.saved_tensors
        rest = saved if ctx.remake is not None else saved[2:]
        params, zs = rest[: ctx.n_params], rest[ctx.n_params :]
        K, linear, n_in = ctx.K, ctx.linear, 8
        need_x = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        double = torch.is_grad_enabled()
        want = [
            i
            for i, p in enumerate(params)
            if p is not None
            and ctx.needs_input_grad[n_in + i]
            and (double or engine_uses(ctx.nodes[i]))
        ]
        grads_p: list = [None] * len(params)
        dx_cos = dx_sin = None
        kernels = not double and not want and ctx.kern is not None
        if not double and not want and zs:  # a force step from the kept z: no x
            x_cos = x_sin = x_eff = None
        else:
            x_cos, x_sin = _CohortStack._rows(ctx, saved)
            x_eff = x_sin  # what the forward computed on (kernels: x_sin[..., 0] = 0)
            if ctx.sin0 and not kernels:  # (a copy: only where the linears recompute)
                with torch.enable_grad():
                    x_eff = _zeroed(x_sin)
        if kernels:  # the kernels: a force step
            family, precision, _ = ctx.kern
            if need_x and zs:  # from their one kept z
                dx_cos, dx_sin = family.stack_backward(
                    zs[0], g_cos, g_sin, params[:K], params[2 * K], precision,
                    ctx.cohort, sin0_zero=ctx.sin0,
                )  # fmt: skip
            elif need_x:  # recomputing each cohort's z from x
                dx_cos, dx_sin = family.stack_recompute_backward(
                    x_cos, x_sin, g_cos, g_sin, params[:K], params[K : 2 * K],
                    params[2 * K], precision, ctx.cohort, sin0_zero=ctx.sin0,
                )  # fmt: skip
        elif not double and not want and zs:  # a force step: from the kept z_k
            if need_x:
                dx_cos, dx_sin = _input_backward(
                    zs, g_cos, g_sin, params, K, linear, ctx.cohort
                )
        elif double:  # a second derivative: the whole stack, differentiably
            xs = [x_cos, x_sin] if need_x else []
            with torch.enable_grad():
                y = _stack(x_cos, x_eff, params, K, linear)
                wrt = xs + [params[i] for i in want]
                got = torch.autograd.grad(
                    y, wrt, (g_cos, g_sin), create_graph=True, allow_unused=True
                )
            if need_x:
                dx_cos, dx_sin = got[0], got[1]
            for i, g in zip(want, got[len(xs) :], strict=True):
                grads_p[i] = torch.zeros_like(params[i]) if g is None else g
        else:
            dx_cos, dx_sin, grads_p = _cohort_backward(
                x_cos, x_eff.detach(), params, g_cos, g_sin, K, linear, ctx.cohort,
                need_x, want,
            )  # fmt: skip
            if ctx.sin0 and dx_sin is not None:
                dx_sin[..., 0] = 0  # the forward did not depend on x_sin[..., 0]
        if not ctx.needs_input_grad[0]:
            dx_cos = None
        if not ctx.needs_input_grad[1]:
            dx_sin = None
        return dx_cos, dx_sin, None, None, None, None, None, None, *grads_p


def mixing_stack(
    x_cos: torch.Tensor,
    x_sin: torch.Tensor,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    weight_out: torch.Tensor,
    bias_out: torch.Tensor | None,
    linear=None,
    cohort_edges: int = COHORT_EDGES,
    recompute: bool = False,
    kernels: str | None = None,
    precision: str = "fp32",
    sin0_zero: bool = False,
    x_rebuild=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The mixing stack of :func:`ecekern.reference.mixing_stack` (same arguments and
    result), its backward in cohorts of at most ``cohort_edges`` rows.

    Args:
        x_cos, x_sin: ``(..., F, n_ang)``, any strides; the leading dimensions are
            the rows (edges).
        weights, biases: the K gated layers' ``(n_ang, F, F)`` and ``(F,)`` or None.
        weight_out, bias_out: the output layer's ``(n_ang, F', F)``, ``(F',)`` or None.
        linear: the EquivariantLinear implementation, ``linear(x_cos, x_sin, weight,
            bias)`` (default: the reference's einsum).
        cohort_edges: rows per cohort, a positive int (with ``kernels``, also the
            kernels' cohorts).
        recompute: keep only x for the backward and recompute each cohort's forward
            there (False: keep the pre-activations z_k too, so that a force step's
            backward runs no linear of the forward again).
        kernels: None (``linear``), or the forward and the force step's backward by
            a kernel family's ``stack_forward`` and ``stack_backward`` (with
            ``recompute``, ``stack_recompute_backward``): ``"layers"``,
            :mod:`ecekern.stack_layers`, or ``"fused"``, :mod:`ecekern.stack_fused`
            (sm_90, F = 192, F' = 96, n_ang = 3). A call the fused stack cannot
            serve runs the layer kernels at ``precision``, and one they cannot
            serve (device, dtype, widths) runs ``linear``, each time with a
            FallbackWarning (:func:`why_not`).
        precision: the kernels' products (:data:`PRECISIONS`): ``"fp32"`` (strict
            fp32 FMA; the only one for float64 rows), ``"3xtf32"``, ``"tf32"``,
            ``"bf16"``; unused without ``kernels``.
        sin0_zero: compute on ``x_sin`` with its m = 0 column taken as zero (the
            m = 0 order has no sin part; the edge frame's rows are built so).
            Then ``y_sin[..., 0] = 0`` and the gradient to ``x_sin[..., 0]`` is
            zero, and the layer kernels skip the m = 0 sin products: ``1/(2
            n_ang)`` of their work (a sixth at n_ang = 3; the fused stack reads
            and writes no m = 0 sin plane but multiplies its zeros). Without the
            kernels (``kernels=None``, or a fallback to the linears) the stack runs
            on a zeroed copy of ``x_sin``, which it keeps in place of ``x_sin``.
        x_rebuild: None, or a callable that makes ``(x_cos, x_sin)`` again, the
            same values (bit for bit) of the same shape; differentiable with grad
            mode on when a second derivative should reach what made x. With it
            the stack keeps no x for the backward: a force step's backward from
            the kept z (``recompute=False``) never calls it, the other backwards
            call it once (the model passes chapter 3's rotation).

    Returns:
        ``y_cos, y_sin``, each ``(..., F', n_ang)``. With ``kernels`` and rows that
        are a planes pair (chapter 3's ``planes=True``), the two are views of one
        planes tensor, handed to the unrotation as they are; autograd then refuses
        to modify either in place (clone it first).

    Raises:
        TypeError: a flag that is not a bool, a non-integer ``cohort_edges``, rows
            that are not tensors, a weight or bias of another dtype than the rows,
            an ``x_rebuild`` that is not callable.
        ValueError: shapes that do not fit together, ``cohort_edges < 1``, an
            unknown ``kernels`` or ``precision``.

    First and second derivatives (a double backward recomputes through
    differentiable linears); ``torch.func`` transforms (``grad``, ``jvp``,
    ``vmap``) are not supported.
    """
    if isinstance(cohort_edges, bool) or not isinstance(
        cohort_edges, _numbers.Integral
    ):
        raise TypeError(f"cohort_edges must be an int, got {cohort_edges!r}")
    if cohort_edges < 1:
        raise ValueError(f"cohort_edges must be at least 1, got {cohort_edges}")
    if not isinstance(recompute, bool):
        raise TypeError(f"recompute must be a bool, got {recompute!r}")
    if not isinstance(sin0_zero, bool):
        raise TypeError(f"sin0_zero must be a bool, got {sin0_zero!r}")
    if x_rebuild is not None and not callable(x_rebuild):
        raise TypeError(f"x_rebuild must be None or callable, got {x_rebuild!r:.60}")
    _check_kernels(kernels, precision)
    for name, seq in (("weights", weights), ("biases", biases)):
        if not isinstance(seq, (list, tuple)):
            raise TypeError(f"{name} must be a list, got {type(seq).__name__}")
    if len(weights) != len(biases):
        raise ValueError(
            f"{len(weights)} weights but {len(biases)} biases: one bias (or None) "
            "per gated layer"
        )
    for name, t in (("x_cos", x_cos), ("x_sin", x_sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.ndim < 2:
            raise ValueError(f"{name} must be (..., F, n_ang), got {tuple(t.shape)}")
    if x_cos.shape != x_sin.shape:
        raise ValueError(
            f"x_cos {tuple(x_cos.shape)} and x_sin {tuple(x_sin.shape)} differ"
        )
    n_ang, F = x_cos.shape[-1], x_cos.shape[-2]
    for name, w, rows in [*((f"weights[{k}]", w, F) for k, w in enumerate(weights)),
                          ("weight_out", weight_out, None)]:  # fmt: skip
        if not isinstance(w, torch.Tensor) or w.ndim != 3:
            raise ValueError(
                f"{name} must be an (n_ang, rows, F) tensor, got {w!r:.60}"
            )
        if w.shape[0] != n_ang or w.shape[2] != F or rows not in (None, w.shape[1]):
            raise ValueError(
                f"{name} is {tuple(w.shape)}, the rows' F = {F}, n_ang = {n_ang}"
            )
        if w.dtype != x_cos.dtype:
            raise TypeError(f"{name} has dtype {w.dtype}, the rows {x_cos.dtype}")
    FO = weight_out.shape[1]
    for name, b, width in [*((f"biases[{k}]", b, F) for k, b in enumerate(biases)),
                           ("bias_out", bias_out, FO)]:  # fmt: skip
        if b is None:
            continue
        if not isinstance(b, torch.Tensor) or b.shape != (width,):
            got = tuple(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__
            raise ValueError(f"{name} must be None or ({width},), got {got}")
        if b.dtype != x_cos.dtype:
            raise TypeError(f"{name} has dtype {b.dtype}, the rows {x_cos.dtype}")
    linear = linear or reference.equivariant_linear
    if torch.compiler.is_compiling():  # the step plan routes a compiled model past
        if kernels is not None:
            options.fallback(f"cohorts.mixing_stack[{kernels} {precision}]",
                             COMPILED, to="the linears")  # fmt: skip
        if sin0_zero:
            x_sin = _zeroed(x_sin)
        return reference.mixing_stack(
            x_cos, x_sin, weights, biases, weight_out, bias_out, linear
        )
    lead, (F, n_ang) = x_cos.shape[:-2], x_cos.shape[-2:]
    rows = (-1, F, n_ang)
    xc, xs = x_cos.reshape(rows), x_sin.reshape(rows)
    params = (*weights, *biases, weight_out, bias_out)
    kernels = _serving(kernels, precision, xc, FO)
    kern = None if kernels is None else (_FAMILY[kernels], precision, sin0_zero)
    zero = sin0_zero and kern is None
    if zero:  # the linears compute on the zeroed column
        xs = _zeroed(xs)
    remake = None
    if x_rebuild is not None:

        def remake():  # x as the forward computed on it
            rc, rs = (t.reshape(rows) for t in x_rebuild())
            return rc, _zeroed(rs) if zero else rs

    K, cohort = len(weights), int(cohort_edges)
    if not torch.is_grad_enabled():  # no_grad, inference_mode: nothing to keep
        y_cos, y_sin, *_ = _forward(xc, xs, params, K, linear, cohort, False, kern)
    else:
        y_cos, y_sin = _CohortStack.apply(
            xc, xs, linear, cohort, recompute, kern, remake, K, *params
        )
    return y_cos.reshape(*lead, *y_cos.shape[1:]), y_sin.reshape(
        *lead, *y_sin.shape[1:]
    )
