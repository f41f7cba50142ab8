"""The fused stack's launchers over one cohort's planes: the forward kernel
(:mod:`.forward_kernel`) and the backward kernel (:mod:`.backward_kernel`) on a
persistent grid, a program per SM (at most one per tile), each taking tiles of 32 edges
in turn; and the checks of the planes and z they index.

Formula, bytes and FLOPs: :mod:`ecekern.stack_fused`'s (these launch its kernels;
the gradients are the backward kernel's dx, no parameter gradients).

Shapes: planes ``(3, 2, n, width)`` (order, cos/sin, edge, feature), rows
contiguous, a plane's sin part and rows within 2**31 values (the order's offset is
int64, the rest int32: ``_check_planes``); ``z (K, 3, 2, n, F)`` a cohort's rows of
a contiguous z, or without one each program's slab of 32 edges (``_slab``: ``6 K 32
F`` values a program, reused tile after tile, in L2).

Status: called by :mod:`ecekern.stack_fused`'s cohort launchers, which check the
call first (:func:`ecekern.stack_fused.why_not`).
"""

from __future__ import annotations

import torch

from .._triton import triton
from .backward_kernel import _fused_bwd_kernel
from .forward_kernel import WARPS, _fused_fwd_kernel
from .ring import BK, F_IN, F_OUT, N_ANG, STAGES, TILE

__all__ = ["backward", "forward"]


def _grid(n_tiles: int, dev) -> int:
    return max(
        1, min(n_tiles, torch.cuda.get_device_properties(dev).multi_processor_count)
    )


def _z_plane(z: torch.Tensor, K: int, n: int) -> int:
    """The plane stride of ``z (K, 3, 2, n, F)``, planes one after another (a
    cohort's rows of a contiguous z are). The kernels offset a plane in int64 and
    index within one, sin part included, in int32."""
    sk, sm, sc, se, sf = z.stride()
    if z.shape != (K, N_ANG, 2, n, F_IN) or (sf, se) != (1, F_IN) or sm != 2 * sc \
            or sk != N_ANG * sm or sc + n * F_IN >= 2**31:  # fmt: skip
        raise ValueError(f"z {tuple(z.shape)} with strides {z.stride()} is not a "
                         "cohort's rows of a contiguous (K, 3, 2, E, F)")  # fmt: skip
    return sc


def _check_planes(n: int, **planes) -> None:
    """Each ``name=(P, width)``: planes ``(3, 2, n, width)``, rows contiguous, that
    the kernels can index: an order's offset in int64, the rest (sin part, edge,
    feature) in int32, so ``P.stride(1) + n width < 2**31``. A ValueError
    otherwise."""
    for name, (P, width) in planes.items():
        if tuple(P.shape) != (N_ANG, 2, n, width):
            raise ValueError(f"{name} is {tuple(P.shape)}, not the fused stack's "
                             f"planes ({N_ANG}, 2, {n}, {width})")  # fmt: skip
        if P.stride(1) + n * width >= 2**31 or P.stride(2) != width or \
                P.stride(3) != 1:  # fmt: skip
            raise ValueError(
                f"{name} {tuple(P.shape)} with strides {P.stride()}: the fused stack "
                "takes planes whose sin part and rows span fewer than 2**31 values, "
                "rows contiguous"
            )


def _slab(like: torch.Tensor, K: int, grid: int) -> tuple:
    """Each program's own rows of z, 32 edges (a tile), and their plane stride:
    what the gates need from z stays in L2, written and read back a tile at a
    time."""
    return like.new_empty((grid, K * 2 * N_ANG * TILE * F_IN)), TILE * F_IN


def forward(xp, prep: tuple, z, yp, sin0: bool) -> None:
    """The stack on planes ``xp (3, 2, n, F)`` into planes ``yp (3, 2, n, F')``,
    with the weights of :func:`~ecekern.stack_fused.ring.forward_weights`; the
    pre-activations into ``z (K, 3, 2, n, F)`` (a cohort's rows of a contiguous z;
    its m = 0 sin planes are not written), or with ``z=None`` only y (the gates' p
    through each program's rows of an L2-sized slab). With ``sin0`` the m = 0 sin
    plane of x is not read and that of y not written. Shapes and precision checked
    by the caller (:func:`ecekern.stack_fused.why_not`)."""
    (w, wl), (wo, wol), b, bo, K, precision = prep
    n = xp.shape[2]
    n_tiles = triton.cdiv(n, TILE)
    if n_tiles == 0:
        return
    _check_planes(n, x=(xp, F_IN), y=(yp, F_OUT))
    grid = _grid(n_tiles, xp.device)
    z, sz = _slab(xp, K, grid) if z is None else (z, _z_plane(z, K, n))
    _fused_fwd_kernel[(grid,)](
        xp, xp.stride(0), xp.stride(1), w, wo, wl, wol,
        xp if b is None else b, xp if bo is None else bo, z, sz,
        yp, yp.stride(0), yp.stride(1), n, n_tiles, K=K, HAS_B=b is not None,
        HAS_BO=bo is not None, SIN0=sin0, X3=precision == "tf32x3",
        FMA=precision == "ieee", BK=BK[precision], STG=STAGES, SLAB=z.ndim == 2,
        num_warps=WARPS,
    )  # fmt: skip


def backward(gp, prep: tuple, z, dxp, sin0: bool, xp=None) -> None:
    """dx into planes ``dxp (3, 2, n, F)`` for the output gradient's planes
    ``gp (3, 2, n, F')``: from the kept ``z (K, 3, 2, n, F)`` (as :func:`forward`
    wrote it), with the weights of
    :func:`~ecekern.stack_fused.ring.backward_weights`; or, with ``z=None`` and
    the stack's input planes ``xp``, recomputing each tile's z from x on chip (the
    weights of ``backward_weights(..., biases=)``; xp may be dxp: a tile reads its
    x before it writes its dx). With ``sin0`` the m = 0 sin planes of the gradient
    and x are not read and that of dx not written."""
    (wt, wtl), (wot, wotl), *b, K, precision = prep
    recomp = z is None
    if recomp != (xp is not None) or recomp != bool(b):
        raise ValueError("the fused backward takes a kept z, or x (z=None) with the "
                         "recomputing backward's weights (their biases)")  # fmt: skip
    n = gp.shape[2]
    n_tiles = triton.cdiv(n, TILE)
    if n_tiles == 0:
        return
    _check_planes(n, dy=(gp, F_OUT), dx=(dxp, F_IN),
                  **({} if xp is None else {"x": (xp, F_IN)}))  # fmt: skip
    grid = _grid(n_tiles, gp.device)
    z, sz = _slab(gp, K, grid) if recomp else (z, _z_plane(z, K, n))
    b = b[0] if recomp else None
    xp = gp if xp is None else xp
    _fused_bwd_kernel[(grid,)](
        gp, gp.stride(0), gp.stride(1), wt, wot, wtl, wotl, z, sz, dxp,
        dxp.stride(0), dxp.stride(1), xp, xp.stride(0), xp.stride(1),
        gp if b is None else b, n, n_tiles, K=K, SIN0=sin0,
        X3=precision == "tf32x3", FMA=precision == "ieee", BK=BK[precision],
        STG=STAGES, RECOMP=recomp, HAS_B=b is not None, num_warps=WARPS,
    )  # fmt: skip
