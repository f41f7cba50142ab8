"""The fused edge layer (chapter 8): rotate, mixing stack, unrotate and aggregate of
one interaction layer in one kernel per edge tile.

Formula (chapter 3's packed frame ``P``, chapter 6's stack; per edge e, side-major
channels ``c' < 2C`` of ``A = [h[dst_e] | h[src_e]]``, feature ``f = c' (L+1) + l``)::

    x_t[e, f, m]   = rho[e, f] sum_{s: l(s) = l} P[e, s, t, m] A[e, s, c']
    u_0 = x;  u_k = u_{k-1} + gate(W_k[m] u_{k-1} + b_k)  (k = 1..K);
    y = W_out[m] u_K + b_out                               (bias on m = 0, cos)
    Delta[n, s, c] = scale sum_{e: dst_e = n} env_e sum_{t, m} P[e, s, t, m]
                     y_t[e, c (L+1) + l(s), m]

Shapes: ``h (N, S, C)``, ``P (E, S, 2, n_ang)``, ``rho (E, F)`` with ``F = 2C(L+1)``
(any strides), ``env (E,)``, ``src, dst (E,)`` int64 with ``dst`` sorted and
``row_ptr (N+1,)`` its CSR pointer, ``weights`` K tensors ``(n_ang, F, F)``,
``biases`` K tensors ``(F,)`` or None, ``weight_out (n_ang, C'(L+1), F)``,
``bias_out (C'(L+1),)`` or None; ``Delta (N, S, C')``. ``scale`` reaches the
kernels as two float32 parts (:func:`~ecekern._triton.split_scale`): Triton passes a
Python float as float32, which alone would cost float64 results 1e-8.

Gradients. A force step's backward (no parameter asks for a gradient) is one more
kernel per edge tile: the tile recomputed (each gated layer's z and the output y
kept in scratch), then in reverse the unrotation's adjoint (``dy``, its share of
``dP``, ``denv``), the stack's (``W^T dz`` and the gates' adjoints) and the
rotation's (``dA``, ``dP``, ``drho``); ``dA``'s dst half is reduced per segment as
in the forward, its src half written per edge and summed per node in src order.
Parameter gradients and second derivatives (training) recompute the layer in
differentiable PyTorch (:func:`edge_layer_torch`) and say so once
(:class:`~ecekern.options.FallbackWarning`).

Bytes (forward): ``P``, ``rho``, ``env`` and the indices read once, ``h`` gathered
(L2-resident), ``Delta`` written once plus two boundary rows a tile; the activations
stay in each program's scratch (``n_programs x n_ang x 2 x BE x (2F + F')``).

Status: forward and force backward tested against the reference composition in
float64 and float32 (Triton's interpreter); not yet run on a GPU, so ``"auto"``
leaves it off.
"""

from __future__ import annotations

import math

import torch

from .. import options, reference
from .._autograd import engine_uses, grad_node, torch_grads
from .._triton import split_scale, tl, triton, why_not_triton
from ..graph import csr_order
from ..so3 import lm_tables
from .kernels import (
    _boundary_kernel,
    _edge_layer_bwd_kernel,
    _edge_layer_fwd_kernel,
    _src_sum_kernel,
)

__all__ = ["PRECISIONS", "edge_layer", "edge_layer_torch", "why_not"]

#: The stack's products, as the step plan names them -> ``tl.dot``'s.
PRECISIONS = {"fp32": "ieee", "3xtf32": "tf32x3", "tf32": "tf32", "bf16": "bf16"}
#: Edges a tile (a power of two, >= 16 for ``tl.dot``).
BLOCK_E = 16
#: Programs a GPU launch runs at most (persistent over the tiles): one per SM of an
#: H100 or H200.
MAX_PROGRAMS = 132
#: Output and inner blocks of the stack's products at most, and warps a program: at
#: 32 x 32 and 8 warps the sm_90 build of the forward keeps 173 registers a thread
#: without spilling, the backward 255 with 520 B of spills (64 x 64 at 4 warps:
#: 255 and 2 KB; ``python -m ecekern.tools.registers`` reads them without a GPU).
BLOCK_N, NUM_WARPS = 32, 8


def why_not(device_type: str, dtype: torch.dtype, F: int) -> str | None:
    """Why the kernel cannot serve a call, or None."""
    why = why_not_triton(device_type)
    if why:
        return why
    if dtype not in (torch.float32, torch.float64):
        return f"{dtype} (the kernel computes in float32 or float64)"
    if device_type == "cuda" and F % 32:
        # tl.dot's blocks (16 at least on a GPU) must divide F and F' = F / 2
        return f"F = {F} is not a multiple of 32 (the GPU's product blocks)"
    return None


def _block(n: int, cap: int = 64) -> int:
    """The largest power of two up to ``cap`` dividing n."""
    return min(cap, n & -n)


def _check(h, P, rho, env, src, dst, row_ptr, weights, biases, w_out, b_out):
    """``(N, E, L, C, NA, F, FO)``; a ValueError or TypeError naming the input."""
    named = [
        ("h", h),
        ("P", P),
        ("rho", rho),
        ("env", env),
        ("weight_out", w_out),
        ("bias_out", b_out),
    ]
    named += [(f"weights[{i}]", w) for i, w in enumerate(weights)]
    named += [(f"biases[{i}]", b) for i, b in enumerate(biases)]
    for name, t in named:
        if t is None and name.startswith("bias"):
            continue
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor")
        if t.dtype != h.dtype or t.device != h.device:
            raise TypeError(f"{name} is {t.dtype} on {t.device}, h {h.dtype} on "
                            f"{h.device}")  # fmt: skip
    if h.ndim != 3 or P.ndim != 4 or P.shape[2] != 2:
        raise ValueError("h must be (N, S, C) and P (E, S, 2, n_ang)")
    N, S, C = h.shape
    E, NA = P.shape[0], P.shape[3]
    L = math.isqrt(S) - 1
    if (L + 1) ** 2 != S or P.shape[1] != S or not 1 <= NA <= L + 1:
        raise ValueError(f"h's S = {S} and P {tuple(P.shape)} do not fit one L")
    F = 2 * C * (L + 1)
    if rho.shape != (E, F) or env.shape != (E,):
        raise ValueError(f"rho must be ({E}, {F}) and env ({E},)")
    for name, t in (("src", src), ("dst", dst)):
        if t.dtype != torch.int64 or t.shape != (E,) or t.device != h.device:
            raise ValueError(f"{name} must be ({E},) int64 on {h.device}")
    if row_ptr.dtype != torch.int64 or row_ptr.shape != (N + 1,):
        raise ValueError(f"row_ptr must be ({N + 1},) int64")
    if len(biases) != len(weights):
        raise ValueError("one bias (or None) per gated weight")
    for w, b in zip(weights, biases):
        if w.shape != (NA, F, F) or (b is not None and b.shape != (F,)):
            raise ValueError(f"gated weights must be ({NA}, {F}, {F}), biases ({F},)")
    FO = C * (L + 1)
    if w_out.shape != (NA, FO, F) or (b_out is not None and b_out.shape != (FO,)):
        raise ValueError(f"weight_out must be ({NA}, {FO}, {F}) and bias_out ({FO},): "
                         "the fused layer's messages have C' = C channels (the "
                         "model's)")  # fmt: skip
    return N, E, L, C, NA, F, FO


def _forward(h, P, rho, env, src, dst, row_ptr, weights, biases, w_out, b_out,
             scale: float, precision: str) -> torch.Tensor:  # fmt: skip
    """The two launches (module docstring); inputs checked."""
    N, E, L, C, NA, F, FO = _check(h, P, rho, env, src, dst, row_ptr, weights,
                                   biases, w_out, b_out)  # fmt: skip
    S, Cp = (L + 1) ** 2, FO // (L + 1)
    out = h.new_empty(N, S, Cp)
    if N == 0:
        return out
    n_tiles, n_prog = _tiles(E, h.is_cuda)
    part = h.new_zeros(max(n_tiles, 1), 2, S, Cp)
    if E:
        scratch = h.new_empty(n_prog, NA * 2 * BLOCK_E * (2 * F + FO))
        _edge_layer_fwd_kernel[(n_prog,)](
            h.contiguous(), P.contiguous(), rho, rho.stride(0), rho.stride(1),
            env.contiguous(), src.contiguous(), dst.contiguous(),
            *_stack_args(weights, biases, w_out, b_out),
            scratch, out, part, *split_scale(scale), E, n_tiles, C,
            **_meta(L, NA, F, FO, len(weights), biases, b_out, precision, h.dtype),
        )  # fmt: skip
    _boundary_kernel[(N,)](row_ptr.contiguous(), dst.contiguous(), part, out, E, Cp,
                           S=S, BE=BLOCK_E,
                           SC=triton.next_power_of_2(S * Cp))  # fmt: skip
    return out


def _tiles(E: int, cuda: bool) -> tuple[int, int]:
    """``(n_tiles, n_programs)`` of a launch over E edges."""
    n_tiles = triton.cdiv(E, BLOCK_E)
    return n_tiles, max(1, min(n_tiles, MAX_PROGRAMS if cuda else 4))


def _stack_args(weights, biases, w_out, b_out) -> tuple:
    """``(w_g (K, NA, F, F), b_g (K, F), w_out, b_out)`` as the kernels read them
    (a missing bias: zeros; an absent tensor: any pointer, never read)."""
    K = len(weights)
    w_g = torch.stack([w.contiguous() for w in weights]) if K else w_out
    b_g = w_out
    if K and any(b is not None for b in biases):
        b_g = torch.stack([torch.zeros_like(w_g[0, 0, 0]) if b is None else b
                           for b in biases])  # fmt: skip
    return w_g, b_g, w_out.contiguous(), w_out if b_out is None else b_out


def _meta(L, NA, F, FO, K, biases, b_out, precision, dtype) -> dict:
    """The kernels' compile-time arguments."""
    Cp = FO // (L + 1)
    return dict(
        L=L, NA=NA, F=F, FO=FO, K=K,
        HAS_BG=any(b is not None for b in biases), HAS_BO=b_out is not None,
        BE=BLOCK_E, BN=_block(F, BLOCK_N), BK=_block(F, BLOCK_N),
        BNO=_block(FO, BLOCK_N), num_warps=NUM_WARPS,
        CP=max(16, triton.next_power_of_2(Cp)), PREC=PRECISIONS[precision],
        DT=tl.float64 if dtype == torch.float64 else tl.float32,
    )  # fmt: skip


def _backward(G, h, P, rho, env, src, dst, row_ptr, weights, biases, w_out, b_out,
              scale: float, precision: str, order=None) -> tuple:  # fmt: skip
    """``(dh, dP, drho, denv)`` of ``<Delta, G>`` by the backward kernel (module
    docstring), its dst reduction's boundary pass and the src sum."""
    N, E, L, C, NA, F, FO = _check(h, P, rho, env, src, dst, row_ptr, weights,
                                   biases, w_out, b_out)  # fmt: skip
    S = (L + 1) ** 2
    dh = h.new_empty(N, S, C)
    dP = torch.zeros(P.shape, dtype=P.dtype, device=P.device)  # contiguous
    drho, denv = h.new_empty(E, F), h.new_empty(E)
    if N == 0:
        return dh, dP, drho, denv
    n_tiles, n_prog = _tiles(E, h.is_cuda)
    part = h.new_zeros(max(n_tiles, 1), 2, S, C)
    dsrc = h.new_empty(E, S, C)
    K = len(weights)
    if E:
        X = NA * 2 * BLOCK_E * F
        scratch = h.new_empty(n_prog, X * (4 + K) + 2 * NA * 2 * BLOCK_E * FO)
        meta = _meta(L, NA, F, FO, K, biases, b_out, precision, h.dtype)
        _edge_layer_bwd_kernel[(n_prog,)](
            G.contiguous(), h.contiguous(), P.contiguous(), rho, rho.stride(0),
            rho.stride(1), env.contiguous(), src.contiguous(), dst.contiguous(),
            *_stack_args(weights, biases, w_out, b_out), scratch, dh, part, dsrc, dP,
            drho, drho.stride(0), drho.stride(1), denv, *split_scale(scale), E, n_tiles,
            C,
            BKO=_block(FO, BLOCK_N), C2=max(16, triton.next_power_of_2(2 * C)),
            **meta,
        )  # fmt: skip
    SC = triton.next_power_of_2(S * C)
    _boundary_kernel[(N,)](row_ptr.contiguous(), dst.contiguous(), part, dh, E, C,
                           S=S, BE=BLOCK_E, SC=SC)  # fmt: skip
    ptr_src, perm_src = csr_order(src, N) if order is None else order
    _src_sum_kernel[(N,)](ptr_src, perm_src, dsrc, dh, E, S=S, C=C, SC=SC)
    return dh, dP, drho, denv


def edge_layer_torch(h, P, rho, env, src, dst, row_ptr, weights, biases, w_out,
                     b_out, scale: float) -> torch.Tensor:  # fmt: skip
    """The module docstring's formula in differentiable PyTorch (the backward's
    recomputation, and a readable specification)."""
    E, S, _, NA = P.shape
    L = math.isqrt(S) - 1
    N, C = h.shape[0], h.shape[2]
    A = torch.cat([h[dst], h[src]], dim=-1)  # (E, S, 2C)
    l_of_s = lm_tables(L).on(h.device).l_of_s
    deg = torch.nn.functional.one_hot(l_of_s, L + 1).to(h.dtype)  # (S, L+1)
    x = torch.einsum("sl,estm,esc->etclm", deg, P, A).reshape(E, 2, 2 * C * (L + 1), NA)
    x = x * rho[:, None, :, None]
    y_cos, y_sin = reference.mixing_stack(x[:, 0], x[:, 1], list(weights),
                                          list(biases), w_out, b_out)  # fmt: skip
    Cp = y_cos.shape[1] // (L + 1)
    y = torch.stack([y_cos, y_sin], 1).reshape(E, 2, Cp, L + 1, NA)[:, :, :, l_of_s]
    msg = torch.einsum("estm,etcsm->esc", P, y)
    return reference.aggregate(msg, dst, N, scale, env)


class _EdgeLayerFn(torch.autograd.Function):
    """The kernels forward; the backward differentiates :func:`edge_layer_torch`."""

    @staticmethod
    def forward(ctx, h, P, rho, env, w_out, b_out, src, dst, row_ptr, scale,
                precision, K, order, *wb):  # fmt: skip
        ctx.save_for_backward(h, P, rho, env, w_out, b_out, src, dst, row_ptr, *wb)
        ctx.scale, ctx.K, ctx.precision, ctx.order = scale, K, precision, order
        ctx.params = [grad_node(t) for t in (w_out, b_out, *wb) if t is not None]
        return _forward(h, P, rho, env, src, dst, row_ptr, wb[:K], wb[K:], w_out,
                        b_out, scale, precision)  # fmt: skip

    @staticmethod
    def backward(ctx, G):
        saved = ctx.saved_tensors
        needs = list(ctx.needs_input_grad[:6]) + list(ctx.needs_input_grad[13:])
        floats = list(saved[:6]) + list(saved[9:])
        if not torch.is_grad_enabled() and not any(engine_uses(n) for n in ctx.params):
            # a force step: the kernels (the parameters get no gradient here)
            h, P, rho, env, w_out, b_out, src, dst, row_ptr, *wb = saved
            K = ctx.K
            dh, dP, drho, denv = _backward(G, h, P, rho, env, src, dst, row_ptr,
                                           wb[:K], wb[K:], w_out, b_out, ctx.scale,
                                           ctx.precision, ctx.order)  # fmt: skip
            grads = [dh, dP, drho, denv] + [None] * (len(needs) - 4)
            grads = [g if need else None for g, need in zip(grads, needs)]
            return (*grads[:6], *[None] * 7, *grads[6:])
        options.fallback("edge_layer backward", "parameter gradients or a second "
                         "derivative (training)", "the layer recomputed in "
                         "differentiable PyTorch")  # fmt: skip
        src, dst, row_ptr = saved[6:9]
        K = ctx.K

        def fn(h, P, rho, env, w_out, b_out, *wb):
            return edge_layer_torch(h, P, rho, env, src, dst, row_ptr, wb[:K],
                                    wb[K:], w_out, b_out, ctx.scale)  # fmt: skip

        # partial derivatives through aliases (the model's rho is made from env,
        # a later layer's h from P: the engine adds those paths once itself)
        grads = torch_grads(fn, floats, needs, (G,))
        return (*grads[:6], *[None] * 7, *grads[6:])


def edge_layer(h, P, rho, env, src, dst, row_ptr, weights, biases, weight_out,
               bias_out, scale: float, precision="fp32", order=None):  # fmt: skip
    """``Delta (N, S, C')`` of one interaction layer (module docstring) by the fused
    kernels; differentiable in every floating-point input. ``precision``: the
    stack's products (``"fp32"``, ``"3xtf32"``, ``"tf32"``, ``"bf16"``; float64
    inputs compute in float64 whatever it says). ``order``: ``(ptr_src,
    perm_src)``, the edges in src order, where the caller has it (the backward's
    src sum). A ValueError where the kernels cannot serve (:func:`why_not`)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {tuple(PRECISIONS)}, got "
                         f"{precision!r}")  # fmt: skip
    if not isinstance(h, torch.Tensor):
        raise TypeError(f"h must be a torch.Tensor, got {type(h).__name__}")
    weights, biases = list(weights), list(biases)
    _check(h, P, rho, env, src, dst, row_ptr, weights, biases, weight_out, bias_out)
    F = rho.shape[1]
    why = why_not(h.device.type, h.dtype, F)
    if why:
        raise ValueError(f"the fused edge layer cannot serve this call: {why}")
    if h.dtype == torch.float64:
        precision = "fp32"  # tl.dot's "ieee": float64 products
    return _EdgeLayerFn.apply(h, P, rho, env, weight_out, bias_out, src, dst,
                              row_ptr, float(scale), precision, len(weights),
                              order, *weights, *biases)  # fmt: skip
