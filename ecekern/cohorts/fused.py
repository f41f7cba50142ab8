"""The mixing stack in one kernel per tile of edges: forward, and the force backward.

Formula (:func:`ecekern.reference.mixing_stack`), for each edge e and order m, cos and
sin alike (the gate couples the orders of a row through its m = 0 cos value p)::

    u_0 = x;  z_k = W_k[m] u_(k-1) (+ b_k at m = 0, cos);  u_k = u_(k-1) + gate(z_k)
    y = W_out[m] u_K (+ b_out at m = 0, cos)

and the force step's backward (no parameter gradients), from the kept ``z_k``::

    du_K = W_out[m]^T dy;  dz_k = gate'(z_k) du_k;  du_(k-1) = du_k + W_k[m]^T dz_k
    dx = du_0

Shapes: ``x_cos, x_sin, dx_cos, dx_sin (E, F, n_ang)``; ``W_k (n_ang, F, F)``;
``W_out (n_ang, F', F)``; ``y_cos, y_sin, dy_cos, dy_sin (E, F', n_ang)``; the
pre-activations ``z (K, 2, E, F, n_ang)`` (cos, sin), written by the forward and read
by the backward instead of recomputing the layers.

A program takes ``BE`` edges at a time (a persistent loop over tiles) and one order
at a time: the linears are block-diagonal in m, so a tile's order-m rows go through
every layer before the next order. The gate's ``s = sigmoid(p)`` (forward) and the
backward's ``sum_(m>=1) du_m z_m`` are the only values that cross orders; the
forward does m = 0 first, the backward m = 0 last. The cos and sin rows of a tile are
one ``(2 BE, F)`` operand, so each product is ``(2 BE, BI) x (BI, BO)`` (chunks of
features, ``CF`` of F and ``CO`` of F'), with W read
from L2 by every tile. The tile's rows live in a per-program scratch, sized by the
number of programs and not by E, so that it stays in L2: forward ``(4 BE + K BE) F``
values, backward ``(2 BE)(2 F + F' + K F)``; ``tl.debug_barrier`` orders a
layer's writes before the next layer's reads.

Bytes model (DRAM): forward, x in, y and the K pre-activations out,
``(2 F n_ang (1 + K) + 2 F' n_ang) E`` values; backward, dy and the ``z_k`` in and
dx out, the same count; the weights, ``(K F + F') F n_ang`` values, once into L2.
FLOPs: ``4 n_ang (K F^2 + F' F) E`` each way.

Precision: ``"ieee"`` (strict fp32 FMA, and float64), ``"tf32"``, ``"tf32x3"``
(Triton's three-pass TF32, fp32-accurate) for float32 inputs. Triton's CPU
interpreter computes every precision in full fp32 (fp64), so only a GPU shows TF32's
rounding.

Gradients: these are the gradients (the backward kernel); no parameter gradients
(:func:`ecekern.cohorts.mixing_stack` computes those by recomputing cohorts).

Status: tested against the reference in float64 (Triton's CPU interpreter) and
float32 on an H200, where it is latency-bound (two programs an SM, the tile's
operands from L2) and no faster than the separate linears; off by default (option
``cohort_fused``).
"""

from __future__ import annotations

import functools

import torch

from .._triton import INTERPRET, tl, triton, why_not_triton

__all__ = ["PRECISIONS", "fused_backward", "fused_forward", "why_not_fused"]

#: ``tl.dot``'s input precisions these kernels accept.
PRECISIONS = ("ieee", "tf32", "tf32x3")
#: Edges a tile (cos and sin rows: twice as many rows a product), forward and
#: backward: the fastest of 16 and 32 on the H200 for tf32x3 (chapter 6's sweep).
BLOCK_EDGES = 32
BLOCK_EDGES_BWD = 16
#: Warps a program, and programs per SM (the persistent grid: at 255 registers a
#: thread, two programs of four warps are what an SM holds).
NUM_WARPS = 4
PER_SM = 2
#: Software-pipelining depth of the inner product loop (Triton's ``num_stages``).
NUM_STAGES = 3


# --------------------------------------------------------------------------------------
# the kernels
# --------------------------------------------------------------------------------------
@triton.jit
def _dot_chunk(src, w, c, NIN: tl.constexpr, SO: tl.constexpr, SI: tl.constexpr,
               R: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr,
               PREC: tl.constexpr, DT: tl.constexpr):  # fmt: skip
    """Output chunk ``c`` (``BO`` wide) of a map: ``acc[r, o] = sum_i src[r, i]
    A[c + o, i]`` for ``R`` rows of ``NIN`` values at ``src``, ``BI`` inputs a
    product; ``A[o, i]`` is at ``w + o SO + i SI`` (``SO = NIN, SI = 1``: W itself;
    ``SO = 1, SI = n_out``: its transpose)."""
    r = tl.arange(0, R)[:, None]
    ji = tl.arange(0, BI)[None, :]
    jo = tl.arange(0, BO)[None, :]
    ii = tl.arange(0, BI)[:, None]
    acc = tl.zeros((R, BO), DT)
    for i in range(0, NIN, BI):
        a = tl.load(src + r * NIN + i + ji)
        wt = tl.load(w + (c + jo) * SO + (i + ii) * SI)  # (in, out)
        acc = tl.dot(a, wt, acc, input_precision=PREC, out_dtype=DT)
    return acc


@triton.jit(do_not_specialize=["E", "n_tiles"])
def _stack_fwd_kernel(x_cos, x_sin, w_all, b_all, w_out, b_out, y_cos, y_sin, z, scr,
                      E, n_tiles, F: tl.constexpr, FO: tl.constexpr,
                      NA: tl.constexpr, K: tl.constexpr, BE: tl.constexpr,
                      CF: tl.constexpr, CO: tl.constexpr, PREC: tl.constexpr,
                      DT: tl.constexpr):  # fmt: skip
    R: tl.constexpr = 2 * BE  # rows: BE cos, then BE sin
    r = tl.arange(0, R)[:, None]
    j = tl.arange(0, CF)[None, :]
    jo = tl.arange(0, CO)[None, :]
    cos = r < BE
    part = (r // BE).to(tl.int64)
    BUF: tl.constexpr = R * F
    pid = tl.program_id(0)
    mine = scr + pid.to(tl.int64) * (2 * BUF + K * BE * F)
    gates = mine + 2 * BUF  # s_k = sigmoid(p_k), K rows of (BE, F)
    EFA = tl.cast(E, tl.int64) * (F * NA)  # one (E, F, n_ang) tensor
    for t in range(pid, n_tiles, tl.num_programs(0)):
        e = tl.cast(t, tl.int64) * BE + r % BE
        ok = e < E
        for m in tl.static_range(NA):  # m = 0 first: it makes the gates
            for c in range(0, F, CF):  # x[m] into buffer 0
                at = e * (F * NA) + (c + j) * NA + m
                v = tl.load(x_cos + at, mask=ok & cos, other=0.0)
                v += tl.load(x_sin + at, mask=ok & (r >= BE), other=0.0)
                tl.store(mine + r * F + c + j, v)
            tl.debug_barrier()
            for k in tl.static_range(K):
                src = mine + (k % 2) * BUF
                dst = mine + ((k + 1) % 2) * BUF
                w = w_all + (k * NA + m) * F * F
                for c in range(0, F, CF):
                    acc = _dot_chunk(src, w, c, F, F, 1, R, CF, CF, PREC, DT)
                    if m == 0:
                        acc += tl.where(cos, tl.load(b_all + k * F + c + j), 0.0)
                    at = (2 * k + part) * EFA + e * (F * NA) + (c + j) * NA + m
                    tl.store(z + at, acc, mask=ok)
                    s_at = gates + k * BE * F + (r % BE) * F + c + j
                    if m == 0:  # SiLU on p (cos rows); the m = 0 sin rows pass
                        s = tl.sigmoid(acc)
                        tl.store(s_at, s, mask=cos)
                        g = tl.where(cos, acc * s, acc)
                    else:
                        g = acc * tl.load(s_at)
                    here = r * F + c + j
                    tl.store(dst + here, tl.load(src + here) + g)
                tl.debug_barrier()
            src = mine + (K % 2) * BUF
            for c in range(0, FO, CO):
                acc = _dot_chunk(src, w_out + m * FO * F, c, F, F, 1, R, CO, CF, PREC,
                                 DT)  # fmt: skip
                if m == 0:
                    acc += tl.where(cos, tl.load(b_out + c + jo), 0.0)
                at = e * (FO * NA) + (c + jo) * NA + m
                tl.store(y_cos + at, acc, mask=ok & cos)
                tl.store(y_sin + at, acc, mask=ok & (r >= BE))
            tl.debug_barrier()  # the next order overwrites the buffers


@triton.jit(do_not_specialize=["E", "n_tiles"])
def _stack_bwd_kernel(g_cos, g_sin, z, w_all, w_out, dx_cos, dx_sin, scr, E, n_tiles,
                      F: tl.constexpr, FO: tl.constexpr, NA: tl.constexpr,
                      K: tl.constexpr, BE: tl.constexpr, CF: tl.constexpr,
                      CO: tl.constexpr, PREC: tl.constexpr,
                      DT: tl.constexpr):  # fmt: skip
    R: tl.constexpr = 2 * BE
    r = tl.arange(0, R)[:, None]
    j = tl.arange(0, CF)[None, :]
    jo = tl.arange(0, CO)[None, :]
    cos = r < BE
    part = (r // BE).to(tl.int64)
    pid = tl.program_id(0)
    du_buf = scr + pid.to(tl.int64) * (R * (2 * F + FO + K * F))
    dz_buf = du_buf + R * F
    g_buf = dz_buf + R * F
    t_buf = g_buf + R * FO  # sum_(m>=1) du_m z_m, K blocks of (R, F)
    EFA = tl.cast(E, tl.int64) * (F * NA)
    for t in range(pid, n_tiles, tl.num_programs(0)):
        e = tl.cast(t, tl.int64) * BE + r % BE
        ok = e < E
        for mi in tl.static_range(NA):
            m = (mi + 1) % NA  # m = 1 .. n_ang - 1, then 0 (a constexpr)
            for c in range(0, FO, CO):  # dy[m] in
                at = e * (FO * NA) + (c + jo) * NA + m
                v = tl.load(g_cos + at, mask=ok & cos, other=0.0)
                v += tl.load(g_sin + at, mask=ok & (r >= BE), other=0.0)
                tl.store(g_buf + r * FO + c + jo, v)
            tl.debug_barrier()
            for c in range(0, F, CF):  # du_K = W_out^T dy
                acc = _dot_chunk(g_buf, w_out + m * FO * F, c, FO, 1, F, R, CF, CO,
                                 PREC, DT)  # fmt: skip
                tl.store(du_buf + r * F + c + j, acc)
            tl.debug_barrier()
            for kk in tl.static_range(K):
                k = K - 1 - kk
                for c in range(0, F, CF):  # dz_k = gate'(z_k) du_k
                    here = r * F + c + j
                    du = tl.load(du_buf + here)
                    at = e * (F * NA) + (c + j) * NA
                    p = tl.load(z + 2 * k * EFA + at, mask=ok, other=0.0)  # cos, m = 0
                    s = tl.sigmoid(p)
                    t_at = t_buf + k * R * F + here
                    if m == 0:
                        if NA > 1:
                            sin_t = tl.load(t_at + BE * F, mask=cos, other=0.0)
                            tt = tl.load(t_at) + sin_t
                        else:
                            tt = 0.0
                        dz = tl.where(cos, du * s + (du * p + tt) * (s * (1 - s)), du)
                    else:
                        at_m = (2 * k + part) * EFA + at + m
                        zm = tl.load(z + at_m, mask=ok, other=0.0)
                        dz = du * s
                        if m == 1:
                            tl.store(t_at, du * zm)
                        else:
                            tl.store(t_at, tl.load(t_at) + du * zm)
                    tl.store(dz_buf + here, dz)
                tl.debug_barrier()
                w = w_all + (k * NA + m) * F * F
                for c in range(0, F, CF):  # du_(k-1) = du_k + W_k^T dz_k, in place
                    acc = _dot_chunk(dz_buf, w, c, F, 1, F, R, CF, CF, PREC, DT)
                    here = r * F + c + j
                    tl.store(du_buf + here, tl.load(du_buf + here) + acc)
                tl.debug_barrier()
            for c in range(0, F, CF):  # dx[m] = du_0 out
                v = tl.load(du_buf + r * F + c + j)
                at = e * (F * NA) + (c + j) * NA + m
                tl.store(dx_cos + at, v, mask=ok & cos)
                tl.store(dx_sin + at, v, mask=ok & (r >= BE))
            tl.debug_barrier()  # the next order overwrites the buffers


# --------------------------------------------------------------------------------------
# the launchers
# --------------------------------------------------------------------------------------
def _chunk(n: int) -> int:
    """A feature chunk: the largest power of two up to 64 dividing n."""
    return min(64, n & -n)


def why_not_fused(x_cos, weights, weight_out, precision: str) -> str | None:
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
    if min(_chunk(F), _chunk(FO)) < 16:
        return f"F and F' must both be multiples of 16 (F = {F}, F' = {FO})"
    return None


def _grid(n_tiles: int, dev, per_sm: int) -> int:
    """Persistent programs: ``per_sm`` per SM (4 in the interpreter), at most a tile
    each."""
    if INTERPRET or dev.type != "cuda":
        return min(n_tiles, 4)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    return min(n_tiles, sms * per_sm)


def _dtypes(dt):
    return tl.float64 if dt == torch.float64 else tl.float32


def _check(name: str, t, shape: tuple, device) -> None:
    """A clear error where a shape or device would send a kernel out of bounds."""
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} is {tuple(t.shape)}, expected {shape}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the rows on {device}")


def _check_weights(weights, weight_out, n_ang, F, FO, device, dtype) -> None:
    for k, w in enumerate(weights):
        _check(f"weights[{k}]", w, (n_ang, F, F), device)
    _check("weight_out", weight_out, (n_ang, FO, F), device)
    for name, w in [*((f"weights[{k}]", w) for k, w in enumerate(weights)),
                    ("weight_out", weight_out)]:  # fmt: skip
        if w.dtype != dtype:
            raise TypeError(f"{name} has dtype {w.dtype} but the rows have {dtype}")


def _served(x_cos, weights, weight_out, precision) -> None:
    if not isinstance(weight_out, torch.Tensor) or weight_out.ndim != 3:
        raise ValueError("weight_out must be an (n_ang, F', F) tensor")
    why = why_not_fused(x_cos, weights, weight_out, precision)
    if why:
        raise ValueError(f"the fused kernels cannot serve this call: {why}")


def fused_forward(x_cos, x_sin, weights, biases, weight_out, bias_out,
                  precision: str = "ieee", block_edges: int = BLOCK_EDGES,
                  num_warps: int = NUM_WARPS, per_sm: int = PER_SM,
                  num_stages: int = NUM_STAGES):  # fmt: skip
    """``(y_cos, y_sin, z)`` of the stack on rows ``(E, F, n_ang)`` (made contiguous),
    ``z (K, 2, E, F, n_ang)`` the pre-activations; the caller checks
    :func:`why_not_fused` first."""
    _served(x_cos, weights, weight_out, precision)
    n_ang, FO, F = weight_out.shape
    E, K, dev, dt = x_cos.shape[0], len(weights), x_cos.device, x_cos.dtype
    _check("x_cos", x_cos, (E, F, n_ang), dev)
    _check("x_sin", x_sin, (E, F, n_ang), dev)
    _check_weights(weights, weight_out, n_ang, F, FO, dev, dt)
    if len(biases) != K:
        raise ValueError(f"{len(biases)} biases for {K} weights")
    for k, b in enumerate([*biases, bias_out]):
        if b is not None:
            _check(f"bias {k}", b, (F if k < K else FO,), dev)
    xc, xs = x_cos.contiguous(), x_sin.contiguous()
    w_all = torch.stack([w.to(dt) for w in weights]) if K else xc.new_zeros(1)
    b_all = torch.stack(
        [xc.new_zeros(F) if b is None else b.to(dt) for b in biases]
    ) if K else xc.new_zeros(1)  # fmt: skip
    b_out = xc.new_zeros(FO) if bias_out is None else bias_out.to(dt).contiguous()
    y_cos = xc.new_empty((E, FO, n_ang))
    y_sin = torch.empty_like(y_cos)
    z = xc.new_empty((K, 2, E, F, n_ang))
    BE = block_edges
    n_tiles = triton.cdiv(E, BE)
    if n_tiles:
        nprog = _grid(n_tiles, dev, per_sm)
        scr = xc.new_empty(nprog * (4 + K) * BE * F)
        _stack_fwd_kernel[(nprog,)](
            xc, xs, w_all.contiguous(), b_all.contiguous(),
            weight_out.to(dt).contiguous(), b_out, y_cos, y_sin, z, scr, E, n_tiles,
            F, FO, NA=n_ang, K=K, BE=BE, CF=_chunk(F), CO=_chunk(FO), PREC=precision,
            DT=_dtypes(dt),
            num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
    return y_cos, y_sin, z


def fused_backward(z, g_cos, g_sin, weights, weight_out, precision: str = "ieee",
                   block_edges: int = BLOCK_EDGES_BWD, num_warps: int = NUM_WARPS,
                   per_sm: int = PER_SM, num_stages: int = NUM_STAGES):  # fmt: skip
    """``(dx_cos, dx_sin)``, each ``(E, F, n_ang)``, of the stack for the output
    gradient ``g (E, F', n_ang)``, from the pre-activations ``z`` that
    :func:`fused_forward` wrote (no parameter gradients)."""
    _served(z, weights, weight_out, precision)
    n_ang, FO, F = weight_out.shape
    K, E, dev, dt = z.shape[0], g_cos.shape[0], g_cos.device, z.dtype
    if len(weights) != K:
        raise ValueError(f"z holds {K} layers' pre-activations, {len(weights)} weights")
    _check("z", z, (K, 2, E, F, n_ang), dev)
    _check("g_cos", g_cos, (E, FO, n_ang), dev)
    _check("g_sin", g_sin, (E, FO, n_ang), dev)
    _check_weights(weights, weight_out, n_ang, F, FO, dev, dt)
    gc, gs = g_cos.to(dt).contiguous(), g_sin.to(dt).contiguous()
    w_all = torch.stack([w.to(dt) for w in weights]) if K else gc.new_zeros(1)
    dx_cos = gc.new_empty((E, F, n_ang))
    dx_sin = torch.empty_like(dx_cos)
    BE = block_edges
    n_tiles = triton.cdiv(E, BE)
    if n_tiles:
        nprog = _grid(n_tiles, dev, per_sm)
        scr = gc.new_empty(nprog * 2 * BE * (2 * F + FO + K * F))
        _stack_bwd_kernel[(nprog,)](
            gc, gs, z.contiguous(), w_all.contiguous(),
            weight_out.to(dt).contiguous(), dx_cos, dx_sin, scr, E, n_tiles, F, FO,
            NA=n_ang, K=K, BE=BE, CF=_chunk(F), CO=_chunk(FO), PREC=precision,
            DT=_dtypes(dt),
            num_warps=num_warps, num_stages=num_stages,
        )  # fmt: skip
    return dx_cos, dx_sin
