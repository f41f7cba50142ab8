"""What the two Gluon kernels of the linear share: the decorator that leaves a plain
function where Gluon is missing, and y's epilogue (the modes joined in registers and
stored with lanes along the outputs)."""

from __future__ import annotations

from .._triton import gl, gluon

__all__ = ["jit", "store_modes"]


def jit(fn):
    """``gluon.jit`` where Gluon is validated here, else the plain function (never
    launched: the plan does not choose a Gluon kernel then)."""
    return gluon.jit(fn) if gluon is not None else fn


@jit
def store_modes(
    acc0, acc1, acc2, y_ptr, b_ptr, row0, col0, B, O, stride_yb,
    HAS_BIAS: gl.constexpr, BB: gl.constexpr, BO: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """Rows ``row0 ..`` and outputs ``col0 ..`` of y ``(B, O, 3)``, ``[BB, BO]`` per
    mode: each mode rounded to y's dtype, the modes joined in registers, ``[BB, BO,
    4]`` (slot 3 a dummy), converted so that lanes run along the outputs (a warp
    stores 32 outputs x 3 modes, 96 contiguous elements of y). Rounding before the
    conversion halves the bytes it moves through shared memory in bf16. The bias
    goes on the m = 0 slot here only for an fp32 y (this kernel), where rounding
    first changes nothing; the tensor-core kernel, whose epilogue this also is,
    starts its m = 0 accumulator at the bias instead."""
    st_l: gl.constexpr = gl.BlockedLayout(
        [1, 1, 4], [1, 32, 1], [num_warps, 1, 1], [2, 1, 0]
    )
    dt: gl.constexpr = y_ptr.dtype.element_ty
    gl.static_assert(dt == gl.float32 or not HAS_BIAS, "bias after rounding: fp32 y")
    a0, a1, a2 = acc0.to(dt), acc1.to(dt), acc2.to(dt)
    t4 = gl.join(gl.join(a0, a2), gl.join(a1, a2)).reshape([BB, BO, 4])
    t4 = gl.convert_layout(t4, st_l)
    r = gl.arange(0, BB, layout=gl.SliceLayout(1, gl.SliceLayout(2, st_l)))
    c = gl.arange(0, BO, layout=gl.SliceLayout(0, gl.SliceLayout(2, st_l)))
    mm = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, st_l)))
    mm = mm[None, None, :]
    rows = row0.to(gl.int64) + r[:, None, None]
    cols = col0 + c[None, :, None]
    if HAS_BIAS:
        bias = gl.load(b_ptr + col0 + c, mask=col0 + c < O, other=0.0)
        t4 = t4 + gl.where(mm == 0, bias.to(gl.float32)[None, :, None], 0.0)
    gl.store(
        y_ptr + rows * stride_yb + cols * 3 + mm,
        t4,
        mask=(rows < B) & (cols < O) & (mm < 3),
    )
