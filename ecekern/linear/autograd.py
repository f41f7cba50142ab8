"""The triton path's autograd: the kernel call that the plan chose, as one
``torch.library`` op, and the Function around it.

Gradients (saved: x_cos, x_sin and W; nothing is recomputed)::

    dx[b, i, m] = sum_o dy[b, o, m] W[m, o, i]    the forward kernel with W^T as w
    dW[m, o, i] = sum_b dy[b, o, m] x[b, i, m]    over cos and sin: dense.bwd_w_gemm
    dbias[o]    = sum_b dy_cos[b, o, 0]

:mod:`ecekern._autograd`'s style: the kernels run inside the op
``ecekern::linear_kernel`` in eager mode and while compiling, and
:class:`EquivariantLinearFn` holds the autograd. The op is a ``custom_op`` everywhere
(opaque to inductor): it chooses its kernel at run time, and the Gluon kernels and
the TMA descriptors cannot be traced. In eager mode the Function skips dW and dbias
when the backward pass will not use them (``_autograd.engine_uses``: a force step
asks for positions only); compiled, it computes the gradients asked for. With grad
mode on in the backward (double backward) the backward is built from this Function
(dx) and an einsum (dW), so it is differentiable again.
"""

from __future__ import annotations

import weakref

import torch

from .. import options
from .._autograd import engine_uses as _engine_uses
from .._autograd import grad_node as _grad_node
from .._autograd import library_op
from .dense import bwd_w_gemm
from .gluon_fma import FmaLaunch, fma_fwd
from .gluon_tc import operand_reason, tc_fwd
from .plan import LAUNCH, Key, kernel_for, precision_key
from .triton_modes import triton_fwd

__all__ = ["EquivariantLinearFn", "run_kernel"]


# --------------------------------------------------------------------------------------
# the transposed weight, kept while the weight does not change
# --------------------------------------------------------------------------------------
#: id(weight) -> (weakref to weight, (version, data_ptr, shape, stride), W^T copy)
_W_T: dict[int, tuple] = {}


def w_t_copy(weight: torch.Tensor) -> torch.Tensor:
    """``weight.transpose(1, 2).contiguous()``, ``(n_ang, K, O)``, made once per weight
    and kept until it changes: the FMA forward reads it as W with O contiguous, the
    tensor-core and TF32 input backwards as a contiguous W^T. Reused only for the same
    tensor at the same version counter, address, shape and strides; nothing is kept
    while a CUDA graph is captured or a trace is compiled (a replay runs no Python),
    nor for inference tensors. Every in-place op bumps the version counter (optimizer
    steps, ``load_state_dict``); an edit through ``.data`` does not, as for any
    PyTorch cache keyed on versions: call ``clear_w_t_cache()`` after one."""
    capturing = torch.compiler.is_compiling() or (
        weight.is_cuda and torch.cuda.is_current_stream_capturing()
    )
    if capturing or weight.is_inference():  # inference tensors have no version
        return weight.detach().transpose(1, 2).contiguous()
    key = id(weight)
    state = (weight._version, weight.data_ptr(), weight.shape, weight.stride())
    hit = _W_T.get(key)
    if hit is not None and hit[0]() is weight and hit[1] == state:
        return hit[2]
    with torch.no_grad():
        w_t = weight.detach().transpose(1, 2).contiguous()
    ref = weakref.ref(weight, lambda _, k=key: _W_T.pop(k, None))
    _W_T[key] = (ref, state, w_t)
    return w_t


def clear_w_t_cache() -> None:
    """Forget every kept W^T (after editing a weight through ``.data``)."""
    _W_T.clear()


# --------------------------------------------------------------------------------------
# the kernel call
# --------------------------------------------------------------------------------------
def layout(x: torch.Tensor, w: torch.Tensor | None) -> tuple[bool, bool]:
    """``(rows contiguous, tensor-core operands)`` of x and w (w None: the input
    backward's kept W^T, always contiguous and aligned; x alone is checked): the
    layout half of the plan's key."""
    rows = x.stride(2) == 1 and x.stride(1) == x.shape[2]
    if torch.compiler.is_compiling():  # no addresses while tracing: alignment is
        # assumed here; the op checks it when it runs (its plan is made then)
        fit = w is None or (w.dtype == x.dtype and w.device == x.device)
        return rows, fit and x.is_contiguous() and (w is None or w.is_contiguous())
    if w is None:
        return rows, x.is_contiguous() and x.data_ptr() % 16 == 0
    return rows, operand_reason(x, w) is None


def _kernel(x, weight, bias, tf32: bool, transposed: bool) -> torch.Tensor:
    n_ang, O, K = weight.shape
    if transposed:  # g (B, O, n_ang) against W^T: K outputs from O inputs
        O, K = K, O
    B = x.shape[0]
    if B == 0 or O == 0 or K == 0:  # nothing to launch: zeros, and the bias
        y = x.new_zeros((B, O, n_ang))
        if bias is not None and B:
            y[:, :, 0] += bias
        return y
    w_tc = None if transposed else weight  # the backward's W^T copy is always fit
    plan = kernel_for(Key(x.device.type, x.dtype, tf32, n_ang, K, O, *layout(x, w_tc)))
    if plan.note:
        options.slower("equivariant_linear", plan.note)
    if plan.kernel == "fma":  # reads w with O contiguous
        w = weight.transpose(1, 2) if transposed else w_t_copy(weight).transpose(1, 2)
        if w.stride(1) != 1:
            w = w.transpose(1, 2).contiguous().transpose(1, 2)
        return fma_fwd(x, w, bias, FmaLaunch())
    if plan.kernel == "tc":  # reads w contiguous
        return tc_fwd(x, w_t_copy(weight) if transposed else weight, bias)
    key = precision_key(x.dtype, tf32)
    w = weight.transpose(1, 2) if transposed else weight
    if transposed and key == "tf32":  # its wgmma wants W^T's tile K-major: a copy
        w = w_t_copy(weight)
    return triton_fwd(x, w, bias, LAUNCH.get(key, LAUNCH["16bit"]), tf32)


def _kernel_fake(x, weight, bias, tf32, transposed):
    n_ang, O, K = weight.shape
    return x.new_empty((x.shape[0], K if transposed else O, n_ang))


@library_op("linear_kernel", _kernel_fake, opaque=True)
def _kernel_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tf32: bool,
    transposed: bool,
) -> torch.Tensor:
    return _kernel(x, weight, bias, tf32, transposed)


def run_kernel(x, weight, bias, tf32: bool, transposed: bool = False) -> torch.Tensor:
    """``y[b, o, m] = sum_k x[b, k, m] W[m, o, k] (+ bias at m = 0)`` for x ``(B, K,
    n_ang)`` (``transposed``: ``sum_k x[b, k, m] W[m, k, o]``, the input backward) by
    the plan's kernel, through the op ``ecekern::linear_kernel``; y contiguous."""
    if bias is not None:
        bias = bias.contiguous()  # the kernels read the bias as contiguous
    return _kernel_op(x, weight, bias, tf32, transposed)


# --------------------------------------------------------------------------------------
# autograd
# --------------------------------------------------------------------------------------
class EquivariantLinearFn(torch.autograd.Function):
    """``(x_cos, x_sin, weight, bias, tf32) -> (y_cos, y_sin)`` by the plan's kernels;
    x ``(B, K, n_ang)``."""

    @staticmethod
    def forward(ctx, x_cos, x_sin, weight, bias, tf32):
        ctx.save_for_backward(x_cos, x_sin, weight)
        ctx.has_bias, ctx.tf32 = bias is not None, tf32
        tracing = torch.compiler.is_compiling()
        ctx.w_node = None if tracing else _grad_node(weight)
        ctx.b_node = None if tracing or bias is None else _grad_node(bias)
        return run_kernel(x_cos, weight, bias, tf32), run_kernel(
            x_sin, weight, None, tf32
        )

    @staticmethod
    def backward(ctx, g_cos, g_sin):
        x_cos, x_sin, weight = ctx.saved_tensors
        dx_cos = dx_sin = dw = db = None
        need_x = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        if torch.compiler.is_compiling():  # the engine's plan is not traceable
            want_w, want_b = ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        else:  # the weight's and the bias's gradients: not in a force step
            want_w = ctx.needs_input_grad[2] and _engine_uses(ctx.w_node)
            want_b = ctx.needs_input_grad[3] and _engine_uses(ctx.b_node)
        want_b = want_b and ctx.has_bias
        if torch.is_grad_enabled():  # double backward: stay differentiable
            if need_x:
                w_t = weight.transpose(1, 2)
                dx_cos, dx_sin = EquivariantLinearFn.apply(
                    g_cos, g_sin, w_t, None, ctx.tf32
                )
            if want_w:
                dw = torch.einsum("bom,bkm->mok", g_cos, x_cos) + torch.einsum(
                    "bom,bkm->mok", g_sin, x_sin
                )
        else:
            if ctx.needs_input_grad[0]:
                dx_cos = run_kernel(g_cos, weight, None, ctx.tf32, transposed=True)
            if ctx.needs_input_grad[1]:
                dx_sin = run_kernel(g_sin, weight, None, ctx.tf32, transposed=True)
            if want_w:
                dw = bwd_w_gemm(g_cos, g_sin, x_cos, x_sin)
        if want_b:
            db = g_cos[:, :, 0].sum(0)
        return dx_cos, dx_sin, dw, db, None
