"""The mixing stack a layer at a time, each layer one GEMM with its gate and residual
in the epilogue: forward, and the force backward.

Formula (:func:`ecekern.reference.mixing_stack`), for each edge e and order m, cos and
sin alike (the gate couples the orders of a row through its m = 0 cos value p)::

    u_0 = x;  z_k = W_k[m] u_(k-1) (+ b_k at m = 0, cos);  u_k = u_(k-1) + gate(z_k)
    y = W_out[m] u_K (+ b_out at m = 0, cos)

and the force step's backward (no parameter gradients), from the kept ``z_k``::

    du_K = W_out[m]^T dy;  dz_k = gate'(z_k) du_k;  du_(k-1) = du_k + W_k[m]^T dz_k
    dx = du_0

One kernel per layer each way. A program owns ``BE`` edges and ``BN`` output
features, for every order and for cos and sin: the orders are block-diagonal, so it
runs one ``(BE, F_in) x (F_in, BN)`` product per order and part, m = 0 first in the
forward (its cos row makes the gate's ``s = sigmoid(p)``) and m = 0 last in the
backward (it needs ``sum_(m>=1) du_m z_m``). The gate, the bias and the residual add
happen on the accumulator before it is stored; nothing of a layer is written twice.

Shapes: ``x_cos, x_sin, dx_cos, dx_sin (E, F, n_ang)``, any strides;
``W_k (n_ang, F, F)``, ``W_out (n_ang, F', F)``; ``y, dy (E, F', n_ang)``. Between
layers the rows are *planes* ``(n_ang, 2, E, F)`` (order, cos/sin, edge, feature),
so that a product's operand rows are contiguous; the kept pre-activations are
``z (K, n_ang, 2, E, F)``.

Bytes model (DRAM, values of ``E F n_ang``, cos and sin): forward, each gated layer
reads u and writes z and u (6), the output layer reads u and writes y
(``2 + 2 F'/F``); backward, the top stage reads dy and z_K and writes du and dz
(``6 + 2 F'/F``), each middle stage reads dz, du and z and writes du and dz (10),
the last reads dz and du and writes dx (6). At K = 2, F' = F/2: 15 forward,
23 backward. FLOPs: ``4 n_ang (K F^2 + F' F) E`` each way.

Precision: ``"ieee"`` (strict fp32 FMA, and float64), ``"tf32"``, ``"tf32x3"``
(Triton's three-pass TF32, fp32-accurate) and ``"bf16"`` (operands rounded to
bfloat16, fp32 accumulation), for float32 rows. Triton's CPU interpreter computes
``"tf32"`` and ``"tf32x3"`` in full precision.

Gradients: these are the gradients (the backward kernels); no parameter gradients
(:func:`ecekern.cohorts.mixing_stack` computes those by recomputing cohorts).

Status: tested against the reference in float64 (Triton's CPU interpreter) and
float32; the force step's stack on CUDA when the option ``cohort_fused`` names a
precision.
"""

from __future__ import annotations

import functools

import torch

from .._triton import INTERPRET, tl, triton, why_not_triton

__all__ = ["PRECISIONS", "stack_backward", "stack_forward", "why_not_layers"]

#: Precisions of the products: ``tl.dot``'s input precisions, and bf16 operands.
PRECISIONS = ("ieee", "tf32", "tf32x3", "bf16")
#: Edges and output features a program, inner-product chunk, warps and pipeline
#: depth, per precision (H200 sweep, chapter 6).
TILES = {
    "ieee": (64, 64, 16, 8, 2),
    "tf32": (128, 64, 32, 8, 3),
    "tf32x3": (128, 64, 32, 8, 3),
    "bf16": (128, 64, 32, 8, 3),
}
#: Copy the stack's input and output to and from planes around the kernels (True),
#: or let the first and last kernels read and write the rows' own strides.
PLANES_IO = False
#: Triton's CPU interpreter truncates to bfloat16 and multiplies bf16 wrongly; it
#: gets the same operands rounded in fp32 instead.
EMULATE_BF16 = tl.constexpr(INTERPRET)


# --------------------------------------------------------------------------------------
# the kernels
# --------------------------------------------------------------------------------------
@triton.jit
def _round_bf16(x):
    """fp32 ``x`` rounded to the nearest bfloat16 (ties to even), kept in fp32."""
    u = x.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.to(tl.float32, bitcast=True)


@triton.jit
def _mm2(a_c, a_s, sa_e, sa_f, e, ok, w, SWO: tl.constexpr, SWI: tl.constexpr, n0,
         KIN: tl.constexpr, BE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
         PREC: tl.constexpr, DT: tl.constexpr):  # fmt: skip
    """``acc[e, n] = sum_i a[e, i] A[n0 + n, i]`` for the cos and the sin rows, with
    ``a[e, i]`` at ``a + e sa_e + i sa_f`` and ``A[o, i]`` at ``w + o SWO + i SWI``
    (``SWO = KIN, SWI = 1``: W itself; ``SWO = 1, SWI = n_out``: its transpose)."""
    kk = tl.arange(0, BK)
    n = n0 + tl.arange(0, BN)
    acc_c = tl.zeros((BE, BN), DT)
    acc_s = tl.zeros((BE, BN), DT)
    row = e[:, None] * sa_e
    for k0 in range(0, KIN, BK):
        wt = tl.load(w + n[None, :] * SWO + (k0 + kk)[:, None] * SWI)  # (in, out)
        at = row + (k0 + kk)[None, :] * sa_f
        xc = tl.load(a_c + at, mask=ok[:, None], other=0.0)
        xs = tl.load(a_s + at, mask=ok[:, None], other=0.0)
        if PREC == "bf16" and EMULATE_BF16:  # the interpreter's bf16 dot is wrong
            wt = _round_bf16(wt)
            acc_c = tl.dot(_round_bf16(xc), wt, acc_c, input_precision="ieee")
            acc_s = tl.dot(_round_bf16(xs), wt, acc_s, input_precision="ieee")
        elif PREC == "bf16":
            wt = wt.to(tl.bfloat16)
            acc_c = tl.dot(xc.to(tl.bfloat16), wt, acc_c, out_dtype=DT)
            acc_s = tl.dot(xs.to(tl.bfloat16), wt, acc_s, out_dtype=DT)
        else:
            acc_c = tl.dot(xc, wt, acc_c, input_precision=PREC, out_dtype=DT)
            acc_s = tl.dot(xs, wt, acc_s, input_precision=PREC, out_dtype=DT)
    return acc_c, acc_s


@triton.jit(do_not_specialize=["E"])
def _layer_fwd_kernel(a_c, a_s, sa_e, sa_f, sa_m, w, b, z_c, z_s, sz_m,
                      o_c, o_s, so_e, so_f, so_m, E,
                      KIN: tl.constexpr, NOUT: tl.constexpr, NA: tl.constexpr,
                      BE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      GATE: tl.constexpr, HAS_B: tl.constexpr, PREC: tl.constexpr,
                      DT: tl.constexpr):  # fmt: skip
    """One layer for BE edges and BN outputs: ``z = W u (+ b)``; with ``GATE``,
    ``z`` is kept (planes, ``z_c + m sz_m + e NOUT + n``) and ``u + gate(z)`` is
    the output, else ``z`` is."""
    NB: tl.constexpr = NOUT // BN
    pid = tl.program_id(0)  # the BN-blocks of an edge block run side by side
    e = (pid // NB).to(tl.int64) * BE + tl.arange(0, BE)
    n0 = (pid % NB) * BN
    n = n0 + tl.arange(0, BN)[None, :]
    ok = e < E
    okk = ok[:, None]
    e2 = e[:, None]
    s = tl.zeros((BE, BN), DT)
    for m in tl.static_range(NA):  # m = 0 first: its cos row makes the gate
        mo = m * tl.cast(sa_m, tl.int64)
        acc_c, acc_s = _mm2(a_c + mo, a_s + mo, sa_e, sa_f, e, ok,
                            w + m * NOUT * KIN, KIN, 1, n0, KIN, BE, BN, BK, PREC,
                            DT)  # fmt: skip
        if HAS_B and m == 0:
            acc_c += tl.load(b + n)
        out = m * tl.cast(so_m, tl.int64) + e2 * so_e + n * so_f
        if GATE:
            zat = m * tl.cast(sz_m, tl.int64) + e2 * NOUT + n
            tl.store(z_c + zat, acc_c, mask=okk)
            tl.store(z_s + zat, acc_s, mask=okk)
            at = mo + e2 * sa_e + n * sa_f  # the residual: u itself (F = F_in)
            if m == 0:  # SiLU on p; the m = 0 sin rows pass ungated
                s = tl.sigmoid(acc_c)
                acc_c = acc_c * s
            else:
                acc_c = acc_c * s
                acc_s = acc_s * s
            acc_c += tl.load(a_c + at, mask=okk, other=0.0)
            acc_s += tl.load(a_s + at, mask=okk, other=0.0)
        tl.store(o_c + out, acc_c, mask=okk)
        tl.store(o_s + out, acc_s, mask=okk)


@triton.jit(do_not_specialize=["E"])
def _layer_bwd_kernel(d_c, d_s, sd_e, sd_f, sd_m, w, r_c, r_s, z_c, z_s, sp_m,
                      u_c, u_s, su_e, su_f, su_m, dz_c, dz_s, E,
                      KIN: tl.constexpr, NOUT: tl.constexpr, NA: tl.constexpr,
                      BE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      RES: tl.constexpr, GATE: tl.constexpr, PREC: tl.constexpr,
                      DT: tl.constexpr):  # fmt: skip
    """One stage of the backward for BE edges and BN features:
    ``du = W^T d (+ r)``, stored at ``u``; with ``GATE``, also ``dz = gate'(z) du``
    for the layer below's kept ``z`` (planes, as r, dz: ``+ m sp_m + e NOUT + n``)."""
    NB: tl.constexpr = NOUT // BN
    pid = tl.program_id(0)
    e = (pid // NB).to(tl.int64) * BE + tl.arange(0, BE)
    n0 = (pid % NB) * BN
    n = n0 + tl.arange(0, BN)[None, :]
    ok = e < E
    okk = ok[:, None]
    e2 = e[:, None]
    if GATE:
        p = tl.load(z_c + e2 * NOUT + n, mask=okk, other=0.0)  # m = 0, cos
        s = tl.sigmoid(p)
        t = tl.zeros((BE, BN), DT)  # sum over m >= 1 of du_m z_m
    for mi in tl.static_range(NA):
        m = (mi + 1) % NA  # m = 1 .. n_ang - 1, then 0 (a constexpr)
        mo = m * tl.cast(sd_m, tl.int64)
        acc_c, acc_s = _mm2(d_c + mo, d_s + mo, sd_e, sd_f, e, ok,
                            w + m * KIN * NOUT, KIN, 1, n0, KIN, BE, BN, BK, PREC,
                            DT)  # fmt: skip
        pat = m * tl.cast(sp_m, tl.int64) + e2 * NOUT + n
        if RES:
            acc_c += tl.load(r_c + pat, mask=okk, other=0.0)
            acc_s += tl.load(r_s + pat, mask=okk, other=0.0)
        tl.store(
            u_c + m * tl.cast(su_m, tl.int64) + e2 * su_e + n * su_f, acc_c, mask=okk
        )
        tl.store(
            u_s + m * tl.cast(su_m, tl.int64) + e2 * su_e + n * su_f, acc_s, mask=okk
        )
        if GATE:
            if m == 0:
                g_c = acc_c * s + (acc_c * p + t) * (s * (1 - s))
                g_s = acc_s
            else:
                t += acc_c * tl.load(z_c + pat, mask=okk, other=0.0)
                t += acc_s * tl.load(z_s + pat, mask=okk, other=0.0)
                g_c = acc_c * s
                g_s = acc_s * s
            tl.store(dz_c + pat, g_c, mask=okk)
            tl.store(dz_s + pat, g_s, mask=okk)


# --------------------------------------------------------------------------------------
# the launchers
# --------------------------------------------------------------------------------------
def _block(n: int) -> int:
    """An output block: the largest power of two up to 64 dividing n."""
    return min(64, n & -n)


def why_not_layers(x_cos, weight_out, precision) -> str | None:
    """Why the kernels cannot serve a call, or None (resolved once per device type,
    dtype, precision and widths, then cached)."""
    if not isinstance(precision, str):
        return f"precision {precision!r} is not one of {PRECISIONS}"
    n_ang, FO, F = weight_out.shape
    return _why_not(x_cos.device.type, x_cos.dtype, precision, F, FO)


@functools.lru_cache(maxsize=64)
def _why_not(device_type: str, dtype, precision, F: int, FO: int) -> str | None:
    why = why_not_triton(device_type)
    if why:
        return why
    if dtype not in (torch.float32, torch.float64):
        return f"dtype {dtype} (float32 and float64 only)"
    if precision not in PRECISIONS:
        return f"precision {precision!r} is not one of {PRECISIONS}"
    if dtype == torch.float64 and precision != "ieee":
        return f"float64 takes precision 'ieee', not {precision!r}"
    if min(_block(F), _block(FO)) < 16:
        return f"F and F' must both be multiples of 16 (F = {F}, F' = {FO})"
    return None


def _check(name: str, t, shape: tuple, device) -> None:
    """A clear error where a shape or device would send a kernel out of bounds."""
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} is {tuple(t.shape)}, expected {shape}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the rows on {device}")


def _checked(x_cos, weights, weight_out, precision, dtype):
    """``(n_ang, F', F)`` after the checks every launcher shares."""
    if not isinstance(weight_out, torch.Tensor) or weight_out.ndim != 3:
        raise ValueError("weight_out must be an (n_ang, F', F) tensor")
    why = why_not_layers(x_cos, weight_out, precision)
    if why:
        raise ValueError(f"the layer kernels cannot serve this call: {why}")
    n_ang, FO, F = weight_out.shape
    named = [*((f"weights[{k}]", w) for k, w in enumerate(weights)),
             ("weight_out", weight_out)]  # fmt: skip
    for name, wt in named:
        _check(name, wt, (n_ang, F if name != "weight_out" else FO, F), x_cos.device)
        if wt.dtype != dtype:
            raise TypeError(f"{name} has dtype {wt.dtype} but the rows have {dtype}")
    return n_ang, FO, F


def _native(a_cos, a_sin):
    """``(cos, sin, stride_e, stride_f, stride_m)`` of ``(E, F, n_ang)`` rows, the
    two parts with one set of strides (else both made contiguous)."""
    if a_cos.stride() != a_sin.stride():
        a_cos, a_sin = a_cos.contiguous(), a_sin.contiguous()
    return (a_cos, a_sin, *a_cos.stride())


def _planes(p):
    """``(cos, sin, stride_e, stride_f, stride_m)`` of planes ``(n_ang, 2, E, F)``."""
    return (p[:, 0], p[:, 1], p.stride(2), 1, p.stride(0))


def _launch(kernel, E: int, NOUT: int, precision: str, tiles, *args, **meta):
    BE, BN, BK, warps, stages = tiles or TILES[precision]
    BN = min(BN, _block(NOUT))
    BK = min(BK, _block(meta["KIN"]))
    grid = (triton.cdiv(E, BE) * (NOUT // BN),)
    kernel[grid](*args, E, NOUT=NOUT, BE=BE, BN=BN, BK=BK, PREC=precision,
                 num_warps=warps, num_stages=stages, **meta)  # fmt: skip


def _dt(dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _to_planes(a_cos, a_sin):
    """``(n_ang, 2, E, F)`` planes of ``(E, F, n_ang)`` rows (one copy)."""
    return torch.stack((a_cos, a_sin)).permute(3, 0, 1, 2).contiguous()


def stack_forward(x_cos, x_sin, weights, biases, weight_out, bias_out,
                  precision: str = "ieee", tiles=None,
                  planes_io: bool | None = None):  # fmt: skip
    """``(y_cos, y_sin, z)`` of the stack on rows ``(E, F, n_ang)``; ``z (K, n_ang,
    2, E, F)`` the pre-activations. ``tiles``: ``(BE, BN, BK, warps, stages)``
    instead of :data:`TILES`; ``planes_io``: copy x to planes and y from planes
    around the kernels instead of reading and writing the rows' strides in them
    (default :data:`PLANES_IO`)."""
    E, dev, dt = x_cos.shape[0], x_cos.device, x_cos.dtype
    K = len(weights)
    n_ang, FO, F = _checked(x_cos, weights, weight_out, precision, dt)
    _check("x_cos", x_cos, (E, F, n_ang), dev)
    _check("x_sin", x_sin, (E, F, n_ang), dev)
    if len(biases) != K:
        raise ValueError(f"{len(biases)} biases for {K} weights")
    for k, bk in enumerate([*biases, bias_out]):
        if bk is not None:
            _check(f"bias {k}", bk, (F if k < K else FO,), dev)
    z = x_cos.new_empty((K, n_ang, 2, E, F))
    y_cos = x_cos.new_empty((E, FO, n_ang))
    y_sin = torch.empty_like(y_cos)
    if E == 0:
        return y_cos, y_sin, z
    planes_io = PLANES_IO if planes_io is None else planes_io
    src = _planes(_to_planes(x_cos, x_sin)) if planes_io else _native(x_cos, x_sin)
    if planes_io:
        yp = x_cos.new_empty((n_ang, 2, E, FO))
    for k in range(K + 1):
        last = k == K
        w = (weight_out if last else weights[k]).contiguous()
        b = bias_out if last else biases[k]
        if last and planes_io:
            out, zc, zs, sz_m = _planes(yp), y_cos, y_sin, 0
        elif last:
            out, zc, zs, sz_m = (y_cos, y_sin, *y_cos.stride()), y_cos, y_sin, 0
        else:
            u = x_cos.new_empty((n_ang, 2, E, F))
            out, zc, zs, sz_m = _planes(u), z[k, :, 0], z[k, :, 1], z.stride(1)
        _launch(_layer_fwd_kernel, E, FO if last else F, precision, tiles,
                *src, w, w if b is None else b.contiguous(), zc, zs, sz_m, *out,
                KIN=F, NA=n_ang, GATE=not last, HAS_B=b is not None,
                DT=_dt(dt))  # fmt: skip
        src = out
    if planes_io:
        y_cos.copy_(yp[:, 0].permute(1, 2, 0))
        y_sin.copy_(yp[:, 1].permute(1, 2, 0))
    return y_cos, y_sin, z


def stack_backward(z, g_cos, g_sin, weights, weight_out, precision: str = "ieee",
                   tiles=None, planes_io: bool | None = None):  # fmt: skip
    """``(dx_cos, dx_sin)``, each ``(E, F, n_ang)``, of the stack for the output
    gradient ``g (E, F', n_ang)`` (any strides), from the pre-activations ``z`` that
    :func:`stack_forward` kept (no parameter gradients)."""
    E, dev, dt = g_cos.shape[0], g_cos.device, z.dtype
    n_ang, FO, F = _checked(z, weights, weight_out, precision, dt)
    K = len(weights)
    _check("z", z, (K, n_ang, 2, E, F), dev)
    _check("g_cos", g_cos, (E, FO, n_ang), dev)
    _check("g_sin", g_sin, (E, FO, n_ang), dev)
    if g_cos.dtype != dt or g_sin.dtype != dt:
        g_cos, g_sin = g_cos.to(dt), g_sin.to(dt)
    dx_cos = g_cos.new_empty((E, F, n_ang))
    dx_sin = torch.empty_like(dx_cos)
    if E == 0:
        return dx_cos, dx_sin
    planes_io = PLANES_IO if planes_io is None else planes_io
    src = _planes(_to_planes(g_cos, g_sin)) if planes_io else _native(g_cos, g_sin)
    du = None
    if planes_io:
        dxp = g_cos.new_empty((n_ang, 2, E, F))
    for k in reversed(range(K + 1)):  # k = K: W_out; then the gated layers
        w = (weight_out if k == K else weights[k]).transpose(1, 2).contiguous()
        gate = k > 0  # dz for the layer below, from its z
        if gate:
            du_new = g_cos.new_empty((n_ang, 2, E, F))
            dz = g_cos.new_empty((n_ang, 2, E, F))
            out, dzc, dzs = _planes(du_new), dz[:, 0], dz[:, 1]
            zc, zs = z[k - 1, :, 0], z[k - 1, :, 1]
        elif planes_io:
            out, dzc, dzs = _planes(dxp), dx_cos, dx_sin
            zc, zs = dx_cos, dx_sin  # not read
        else:
            out, dzc, dzs = (dx_cos, dx_sin, *dx_cos.stride()), dx_cos, dx_sin
            zc, zs = dx_cos, dx_sin  # not read
        rc, rs = (du[:, 0], du[:, 1]) if du is not None else (dx_cos, dx_sin)
        _launch(_layer_bwd_kernel, E, F, precision, tiles,
                *src, w, rc, rs, zc, zs, z.stride(1), *out, dzc, dzs,
                KIN=FO if k == K else F, NA=n_ang, RES=du is not None, GATE=gate,
                DT=_dt(dt))  # fmt: skip
        if gate:
            src, du = _planes(dz), du_new
    if planes_io:
        dx_cos.copy_(dxp[:, 0].permute(1, 2, 0))
        dx_sin.copy_(dxp[:, 1].permute(1, 2, 0))
    return dx_cos, dx_sin
