"""EquivariantLinear (chapter 2): ``y[b, o, m] = sum_i x[b, i, m] W[m, o, i]``, bias on
the m = 0 cos slot.

Shapes: ``x_cos, x_sin (..., K, n_ang)`` with K in features, ``W (n_ang, O, K)``,
``bias (O,)``, ``y_cos, y_sin (..., O, n_ang)``; the leading dims flatten to B rows.
The same ``W[m]`` acts on cos and sin, which is what makes the map commute with
rotations about the edge axis.

Gradients: ``dx = dy W`` per mode, ``dW = dy^T x`` over cos and sin, ``dbias = sum of
dy_cos[:, :, 0]`` (:mod:`.autograd`).

Paths, one file each, chosen by :mod:`.plan` once per (device, dtype, TF32, shape,
layout):

* ``einsum``: the reference, :func:`ecekern.reference.equivariant_linear`;
* ``dense`` (:mod:`.dense`): one GEMM against the block-diagonal weight, n_ang times
  the flops;
* ``triton``: one dot per mode, no zero blocks, by the Gluon FMA kernel
  (:mod:`.gluon_fma`, strict fp32), the Gluon tensor-core kernel (:mod:`.gluon_tc`,
  bf16), or the Triton kernel (:mod:`.triton_modes`, every other case).

Bytes per call (cos and sin): ``2 s B n_ang (K + O)`` plus W; flops ``4 B K O n_ang``,
so ``K O / (2 (K + O))`` flop/byte in fp32 (48 at K = O = 192): arithmetic-bound on
the FMA units in strict fp32, memory-bound on the tensor cores.

Status: every path matches the einsum in fp64 to 1e-12 (forward, first and second
derivatives); fp32, TF32, bf16 and fp16 within the three-way rule; CUDA, and the CPU
through Triton's interpreter. The triton path is :mod:`ecekern._autograd`'s style:
its kernels run inside one opaque ``torch.library`` op (``ecekern::linear_kernel``) in
eager mode and while compiling, with the autograd in a Function around it
(:mod:`.autograd`); ``torch.compile`` sees that op as a leaf.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .. import options, reference
from . import dense as _dense
from .autograd import EquivariantLinearFn, layout
from .plan import PATHS, Key, Plan, auto_path, path_for

__all__ = ["EquivariantLinear", "Plan", "auto_path", "equivariant_linear", "plan_of"]


def plan_of(x_cos: torch.Tensor, weight: torch.Tensor, path: str = "auto") -> Plan:
    """The plan a call with ``x_cos (..., K, n_ang)`` and ``weight (n_ang, O, K)``
    gets on this device, with TF32 as it is now: path, kernel, and any note."""
    n_ang, O, K = weight.shape
    x3 = x_cos if x_cos.dim() == 3 else x_cos.reshape(-1, K, n_ang)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    return path_for(
        path,
        Key(x_cos.device.type, x_cos.dtype, tf32, n_ang, K, O, *layout(x3, weight)),
    )


def equivariant_linear(x_cos, x_sin, weight, bias, path: str = "auto"):
    """Computes the same as :func:`ecekern.reference.equivariant_linear`.

    Args:
        x_cos, x_sin: ``(..., in, n_ang)``, any strides.
        weight: ``(n_ang, out, in)``, any strides.
        bias: ``(out,)`` or None, any strides.
        path: ``"einsum"``, ``"dense"``, ``"triton"``, or ``"auto"`` (the measured
            choice of :mod:`ecekern.linear.plan` for this device, dtype, TF32 switch
            and shape).

    Returns:
        ``y_cos, y_sin``, each ``(..., out, n_ang)`` (contiguous on the dense and
        triton paths).
    """
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    reference._check_equivariant_linear(x_cos, x_sin, weight, bias)
    n_ang, O, K = weight.shape
    lead = x_cos.shape[:-2]
    xc = x_cos if x_cos.dim() == 3 else x_cos.reshape(-1, K, n_ang)
    xs = x_sin if x_sin.dim() == 3 else x_sin.reshape(-1, K, n_ang)
    tf32 = torch.backends.cuda.matmul.allow_tf32  # read here, once per call
    p = path_for(
        path, Key(xc.device.type, xc.dtype, tf32, n_ang, K, O, *layout(xc, weight))
    )
    if p.fallback:
        options.fallback("equivariant_linear[triton]", p.note)
    elif p.note:
        options.slower("equivariant_linear", p.note)
    if p.path == "einsum":
        return reference.equivariant_linear(x_cos, x_sin, weight, bias)
    if p.path == "dense":
        return _dense.dense(x_cos, x_sin, weight, bias)
    y_cos, y_sin = EquivariantLinearFn.apply(xc, xs, weight, bias, tf32)
    return y_cos.reshape(*lead, O, n_ang), y_sin.reshape(*lead, O, n_ang)


class EquivariantLinear(nn.Module):
    """SO(2)-equivariant linear map of the angular layout, ``(..., in, n_ang)`` pairs.

    The parameters ``weight (n_ang, out, in)`` and ``bias (out,)`` are the same for
    every path, so a ``state_dict`` loads across paths unchanged.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        n_ang: int,
        bias: bool = True,
        path: str = "auto",
    ):
        super().__init__()
        for name, v in (
            ("in_features", in_features),
            ("out_features", out_features),
            ("n_ang", n_ang),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {path!r}")
        self.in_features, self.out_features = in_features, out_features
        self.n_ang, self.path = n_ang, path
        self.weight = nn.Parameter(torch.empty(n_ang, out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=1.0 / math.sqrt(self.in_features))
        if self.bias is not None:
            nn.init.normal_(self.bias, std=0.1)

    def forward(self, x_cos: torch.Tensor, x_sin: torch.Tensor):
        return equivariant_linear(x_cos, x_sin, self.weight, self.bias, self.path)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"n_ang={self.n_ang}, bias={self.bias is not None}, path={self.path!r}"
        )


def traffic(B: int, K: int, O: int, n_ang: int, elem_size: int) -> dict:
    """The bytes and flops model of one forward call (cos and sin) on B rows:
    ``bytes`` (x read once, y written once, W once), ``flops`` (the per-mode products,
    what the triton path does), ``flops_dense`` (the block-diagonal GEMM's)."""
    return {
        "bytes": elem_size * (2 * B * n_ang * (K + O) + n_ang * O * K + O),
        "flops": 2 * 2 * B * K * O * n_ang,
        "flops_dense": 2 * 2 * B * K * O * n_ang * n_ang,
    }
