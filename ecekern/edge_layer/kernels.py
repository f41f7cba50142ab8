"""The fused edge layer's Triton kernels (chapter 8): one program per edge tile runs
the rotation, the whole mixing stack, the unrotation and the tile's share of the
dst reduction; a second, small kernel adds the tiles' boundary partials.

Formula and shapes: :mod:`ecekern.edge_layer`. A program owns tiles of ``BE``
consecutive edges of the dst-sorted order (persistent: tile ``pid``, ``pid +
n_programs``, ...). Its activations live in a scratch slice of its own, ``(n_ang, 2,
BE, F)`` twice and ``(n_ang, 2, BE, F')`` once (184 KB in fp32 at the book's widths;
the backward's 516 KB), because ``tl.dot`` takes its operand blocks from memory;
nothing of an edge but the tile's node sums leaves the program.

Reduction into dst, deterministic: a tile's edges form segments of equal dst (rank
``seg``). A one-hot product sums each segment; the inner segments are whole and are
written to ``Delta`` directly, the first and the last (which may continue in the
neighbouring tiles) go to ``partial (n_tiles, 2, S, C')``, and :func:`_boundary_kernel`
adds a node's partials over its tiles in tile order. No atomics.

Precisions (``tl.dot``): ``"ieee"`` (strict fp32, and float64), ``"tf32"``,
``"tf32x3"`` (``lo hi + hi lo + hi hi``; both operands split in registers) and
``"bf16"`` (operands rounded to bfloat16, fp32 sums; emulated in the interpreter).
"""

from __future__ import annotations

from .._triton import INTERPRET, round_bf16, round_tf32, tl, triton

#: Triton's interpreter multiplies bfloat16 wrongly: it gets the operands rounded in
#: fp32 instead.
EMULATE_BF16 = tl.constexpr(INTERPRET)


@triton.jit
def _dot(x, w, acc, PREC: tl.constexpr, DT: tl.constexpr):
    """``acc + x @ w`` in the precision ``PREC``."""
    if PREC == "tf32x3":
        x_hi = round_tf32(x)
        w_hi = round_tf32(w)
        c = tl.dot(x - x_hi, w_hi, input_precision="tf32", out_dtype=DT)
        c = tl.dot(x_hi, w - w_hi, c, input_precision="tf32", out_dtype=DT)
        return acc + tl.dot(x_hi, w_hi, c, input_precision="tf32", out_dtype=DT)
    elif PREC == "bf16" and EMULATE_BF16:
        return tl.dot(round_bf16(x), round_bf16(w), acc, input_precision="ieee")
    elif PREC == "bf16":
        return tl.dot(x.to(tl.bfloat16), w.to(tl.bfloat16), acc, out_dtype=DT)
    else:
        return tl.dot(x, w, acc, input_precision=PREC, out_dtype=DT)


@triton.jit
def _linear(u, w, n0, KIN: tl.constexpr, SN: tl.constexpr, SK: tl.constexpr,
            BE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
            PREC: tl.constexpr, DT: tl.constexpr):  # fmt: skip
    """``acc[e, n] = sum_i u[e, i] B[n0 + n, i]``: the tile's rows ``u`` (scratch,
    ``BE x KIN``, row-major) against ``B[n, i]`` at ``w + n SN + i SK`` (one order's
    W with ``(KIN, 1)``, its transpose with ``(1, width)``)."""
    kk = tl.arange(0, BK)
    n = n0 + tl.arange(0, BN)
    rows = tl.arange(0, BE)
    acc = tl.zeros((BE, BN), DT)
    for k0 in range(0, KIN, BK):
        a = tl.load(u + rows[:, None] * KIN + (k0 + kk)[None, :])
        b = tl.load(w + n[None, :] * SN + (k0 + kk)[:, None] * SK)  # (in, out)
        acc = _dot(a, b, acc, PREC, DT)
    return acc


@triton.jit
def _rotate(h, P, rho, s_re, s_rf, src, dst, e, ok, xs, C, L: tl.constexpr,
            NA: tl.constexpr, F: tl.constexpr, BE: tl.constexpr, BN: tl.constexpr,
            DT: tl.constexpr):  # fmt: skip
    """The stack's input into scratch ``xs (NA, 2, BE, F)``: ``x_t[e, f, m] =
    rho[e, f] sum_{s in l(f)} P[e, s, t, m] A[e, s, c(f)]``, feature ``f = c (L+1)
    + l``, ``A = [h[dst] | h[src]]``."""
    S: tl.constexpr = (L + 1) * (L + 1)
    rows = tl.arange(0, BE)
    node_d = tl.load(dst + e, mask=ok, other=0)
    node_s = tl.load(src + e, mask=ok, other=0)
    for n0 in range(0, F, BN):
        f = n0 + tl.arange(0, BN)
        l = f % (L + 1)
        cp = f // (L + 1)
        node = tl.where((cp < C)[None, :], node_d[:, None], node_s[:, None])
        hrow = node * (S * C) + (cp % C)[None, :]  # h[node, 0, c]
        r = tl.load(rho + e[:, None] * s_re + f[None, :] * s_rf, mask=ok[:, None],
                    other=0.0).to(DT)  # fmt: skip
        for m in tl.static_range(NA):
            for t in tl.static_range(2):
                acc = tl.zeros((BE, BN), DT)
                for i in tl.static_range(2 * L + 1):
                    s = l * l + i  # the degree's columns; i < 2l + 1
                    take = ok[:, None] & (i < 2 * l + 1)[None, :]
                    a = tl.load(h + hrow + s[None, :] * C, mask=take, other=0.0)
                    p = tl.load(P + e[:, None] * (S * 2 * NA) + s[None, :] * (2 * NA)
                                + t * NA + m, mask=take, other=0.0)  # fmt: skip
                    acc += a.to(DT) * p.to(DT)
                at = xs + (m * 2 + t) * (BE * F) + rows[:, None] * F + f[None, :]
                tl.store(at, acc * r)


@triton.jit
def _layer(us, os, w, b, HAS_B: tl.constexpr, GATE: tl.constexpr, KIN: tl.constexpr,
           NOUT: tl.constexpr, NA: tl.constexpr, BE: tl.constexpr, BN: tl.constexpr,
           BK: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr, zs=None,
           KEEP: tl.constexpr = False):  # fmt: skip
    """One layer of the stack, scratch to scratch: ``z = W[m] u (+ b at m = 0,
    cos)``; gated: ``u + gate(z)`` (SiLU on m = 0 cos, the orders m >= 1 times its
    sigmoid, m = 0 sin ungated), else z; with ``KEEP``, z into ``zs`` too. m = 0
    runs first: its cos makes the gate."""
    rows = tl.arange(0, BE)
    for n0 in range(0, NOUT, BN):
        n = n0 + tl.arange(0, BN)
        g = tl.zeros((BE, BN), DT)
        for m in tl.static_range(NA):
            for t in tl.static_range(2):
                src = us + (m * 2 + t) * (BE * KIN)
                acc = _linear(src, w + m * NOUT * KIN, n0, KIN, KIN, 1, BE, BN, BK,
                              PREC, DT)  # fmt: skip
                if HAS_B and m == 0 and t == 0:
                    acc += tl.load(b + n).to(DT)[None, :]
                if KEEP:
                    tl.store(zs + (m * 2 + t) * (BE * NOUT) + rows[:, None] * NOUT
                             + n[None, :], acc)  # fmt: skip
                if GATE:
                    if m == 0 and t == 0:
                        g = tl.sigmoid(acc)
                        acc = acc * g
                    elif m > 0:
                        acc = acc * g
                    acc += tl.load(src + rows[:, None] * KIN + n[None, :])  # residual
                tl.store(os + (m * 2 + t) * (BE * NOUT) + rows[:, None] * NOUT
                         + n[None, :], acc)  # fmt: skip


@triton.jit
def _unrotate_reduce(ys, P, env, dst, e, ok, e0, E, tile, out, part, scale_hi,
                     scale_lo, C, L: tl.constexpr, NA: tl.constexpr,
                     FO: tl.constexpr, BE: tl.constexpr, CP: tl.constexpr,
                     DT: tl.constexpr):  # fmt: skip
    """``msg[e, s, c] = k w_e sum_{t, m} P[e, s, t, m] y_t[e, c (L+1) + l(s), m]``,
    summed per dst segment of the tile by a one-hot product: inner segments into
    ``out`` (N, S, C'), the first and last into ``part[tile]`` (2, S, C')."""
    # [book: el-reduce]
    S: tl.constexpr = (L + 1) * (L + 1)
    rows = tl.arange(0, BE)
    c = tl.arange(0, CP)
    mc = c < C
    d = tl.load(dst + e, mask=ok, other=-1)
    prev = tl.load(dst + e - 1, mask=ok & (rows > 0), other=-1)
    start = (rows > 0) & ok & (d != prev)
    seg = tl.cumsum(start.to(tl.int32), 0)  # the edge's segment rank in the tile
    last = tl.max(tl.where(ok, seg, 0), 0)
    onehot = tl.where((rows[:, None] == seg[None, :]) & ok[None, :], 1.0, 0.0).to(DT)
    node = tl.max(tl.where(rows[:, None] == seg[None, :], d[None, :], -1), 1)
    w = tl.load(env + e, mask=ok, other=0.0).to(DT)
    w = w * scale_hi + w * scale_lo  # scale to 48 bits in float64
    inner = (rows > 0) & (rows < last)
    for l in tl.static_range(L + 1):
        for i in tl.static_range(2 * l + 1):
            s = l * l + i
            msg = tl.zeros((BE, CP), DT)
            for m in tl.static_range(NA):
                for t in tl.static_range(2):
                    p = tl.load(P + e * (S * 2 * NA) + s * (2 * NA) + t * NA + m,
                                mask=ok, other=0.0).to(DT)  # fmt: skip
                    y = tl.load(ys + (m * 2 + t) * (BE * FO) + rows[:, None] * FO
                                + (c * (L + 1) + l)[None, :], mask=mc[None, :],
                                other=0.0)  # fmt: skip
                    msg += p[:, None] * y
            msg = msg * w[:, None]
            sums = tl.dot(onehot, msg, input_precision="ieee", out_dtype=DT)
            tl.store(out + node[:, None].to(tl.int64) * (S * C) + s * C + c[None, :],
                     sums, mask=inner[:, None] & mc[None, :])  # fmt: skip
            first = part + tl.cast(tile, tl.int64) * (2 * S * C) + s * C + c
            tl.store(first, tl.sum(tl.where((rows == 0)[:, None], sums, 0.0), 0),
                     mask=mc)  # fmt: skip
            tl.store(first + S * C,
                     tl.sum(tl.where((rows == last)[:, None], sums, 0.0), 0),
                     mask=mc & (last > 0))  # fmt: skip
    # [/book: el-reduce]


@triton.jit
def _tile_forward(h, P, rho, s_re, s_rf, src, dst, e, ok, u0, u1, ys, zk, w_g, b_g,
                  w_o, b_o, C, L: tl.constexpr, NA: tl.constexpr, F: tl.constexpr,
                  FO: tl.constexpr, K: tl.constexpr, HAS_BG: tl.constexpr,
                  HAS_BO: tl.constexpr, BE: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, BNO: tl.constexpr, PREC: tl.constexpr,
                  DT: tl.constexpr, KEEP: tl.constexpr):  # fmt: skip
    """The tile's rotation, K gated layers (their z into ``zk`` with ``KEEP``) and
    the output layer into ``ys``, through the scratch ``u0``, ``u1``; each phase
    ends at a barrier (the next reads what other threads wrote)."""
    # [book: el-tile]
    X: tl.constexpr = NA * 2 * BE * F
    _rotate(h, P, rho, s_re, s_rf, src, dst, e, ok, u0, C, L, NA, F, BE, BN, DT)
    tl.debug_barrier()
    for k in tl.static_range(K):
        a = u0 if k % 2 == 0 else u1
        o = u1 if k % 2 == 0 else u0
        _layer(a, o, w_g + k * (NA * F * F), b_g + k * F, HAS_BG, True, F, F, NA, BE,
               BN, BK, PREC, DT, zk + k * X, KEEP)  # fmt: skip
        tl.debug_barrier()
    a = u0 if K % 2 == 0 else u1
    _layer(a, ys, w_o, b_o, HAS_BO, False, F, FO, NA, BE, BNO, BK, PREC, DT)
    tl.debug_barrier()
    # [/book: el-tile]


@triton.jit(do_not_specialize=["E", "n_tiles"])
def _edge_layer_fwd_kernel(
    h, P, rho, s_re, s_rf, env, src, dst, w_g, b_g, w_o, b_o, scratch, out, part,
    scale_hi, scale_lo, E, n_tiles, C,
    L: tl.constexpr, NA: tl.constexpr, F: tl.constexpr, FO: tl.constexpr,
    K: tl.constexpr, HAS_BG: tl.constexpr, HAS_BO: tl.constexpr, BE: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, BNO: tl.constexpr, CP: tl.constexpr,
    PREC: tl.constexpr, DT: tl.constexpr,
):  # fmt: skip
    """Tiles ``pid, pid + n_programs, ...``: rotate, K gated layers and the output
    layer, unrotate and reduce, each phase ending at a barrier (the next reads what
    other threads wrote to the program's scratch)."""
    # [book: el-fwd]
    pid = tl.program_id(0)
    per: tl.constexpr = NA * 2 * BE * (2 * F + FO)
    u0 = scratch + pid.to(tl.int64) * per
    u1 = u0 + NA * 2 * BE * F
    ys = u1 + NA * 2 * BE * F
    for tile in range(pid, n_tiles, tl.num_programs(0)):
        e0 = tl.cast(tile, tl.int64) * BE
        e = e0 + tl.arange(0, BE)
        ok = e < E
        _tile_forward(h, P, rho, s_re, s_rf, src, dst, e, ok, u0, u1, ys, u0, w_g,
                      b_g, w_o, b_o, C, L, NA, F, FO, K, HAS_BG, HAS_BO, BE, BN, BK,
                      BNO, PREC, DT, False)  # fmt: skip
        _unrotate_reduce(ys, P, env, dst, e, ok, e0, E, tile, out, part, scale_hi,
                         scale_lo, C, L, NA, FO, BE, CP, DT)  # fmt: skip
        tl.debug_barrier()
    # [/book: el-fwd]


@triton.jit(do_not_specialize=["E"])
def _boundary_kernel(row_ptr, dst, part, out, E, C, S: tl.constexpr,
                     BE: tl.constexpr, SC: tl.constexpr):  # fmt: skip
    """Node n: zero without edges; written by its tile when it is an inner segment
    of one tile; else the sum of its partials over the tiles it spans, in tile
    order (slot 0 where it is the tile's first node, else slot 1)."""
    n = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, SC)
    mj = j < S * C
    lo = tl.load(row_ptr + n)
    hi = tl.load(row_ptr + n + 1)
    t0 = lo // BE
    t1 = (hi - 1) // BE
    first0 = tl.load(dst + t0 * BE, mask=hi > lo, other=-1)
    last0 = tl.load(dst + tl.minimum(t0 * BE + BE, E) - 1, mask=hi > lo, other=-1)
    own = (hi > lo) & (t0 == t1) & (first0 != n) & (last0 != n)
    if not own:
        acc = tl.zeros((SC,), part.dtype.element_ty)
        for t in range(t0, t1 + 1):
            if hi > lo:
                slot = tl.where(tl.load(dst + t * BE) == n, 0, 1)
                acc += tl.load(part + (t * 2 + slot) * (S * C) + j, mask=mj, other=0.0)
        tl.store(out + n * (S * C) + j, acc, mask=mj)


# --------------------------------------------------------------------------------------
# the force backward: the tile recomputed, then every adjoint in reverse
# --------------------------------------------------------------------------------------
@triton.jit
def _segments(dst, e, ok, BE: tl.constexpr):
    """The tile's dst segments: each edge's rank ``seg``, the last rank, the
    one-hot ``(rank, edge)`` matrix (0/1, int) and each rank's node."""
    rows = tl.arange(0, BE)
    d = tl.load(dst + e, mask=ok, other=-1)
    prev = tl.load(dst + e - 1, mask=ok & (rows > 0), other=-1)
    start = (rows > 0) & ok & (d != prev)
    seg = tl.cumsum(start.to(tl.int32), 0)
    last = tl.max(tl.where(ok, seg, 0), 0)
    hit = (rows[:, None] == seg[None, :]) & ok[None, :]
    node = tl.max(tl.where(hit, d[None, :], -1), 1)
    return d, last, hit, node


@triton.jit
def _unrotate_adjoint(ys, dys, P, env, G, d, e, ok, dP, denv, scale_hi, scale_lo,
                      C, L: tl.constexpr, NA: tl.constexpr, FO: tl.constexpr,
                      BE: tl.constexpr, CP: tl.constexpr,
                      DT: tl.constexpr):  # fmt: skip
    """From ``G = dLoss/dDelta``: ``dy_t[e, c (L+1) + l, m] = k w_e sum_{s in l}
    P[e, s, t, m] G[dst_e, s, c]`` into scratch; ``dP[e, s, t, m] = k w_e sum_c
    y_t[e, c (L+1) + l(s), m] G[dst_e, s, c]`` (the rotation's share is added
    later); ``denv[e] = k sum_{s, c, t, m} P y G``."""
    S: tl.constexpr = (L + 1) * (L + 1)
    rows = tl.arange(0, BE)
    c = tl.arange(0, CP)
    mc = c < C
    m2 = ok[:, None] & mc[None, :]
    w = tl.load(env + e, mask=ok, other=0.0).to(DT)
    w = w * scale_hi + w * scale_lo  # scale to 48 bits in float64
    dw = tl.zeros((BE,), DT)
    for l in tl.static_range(L + 1):
        for m in tl.static_range(NA):
            for t in tl.static_range(2):
                col = (
                    (m * 2 + t) * (BE * FO)
                    + rows[:, None] * FO
                    + (c * (L + 1) + l)[None, :]
                )
                y = tl.load(ys + col, mask=mc[None, :], other=0.0)
                acc = tl.zeros((BE, CP), DT)
                for i in tl.static_range(2 * l + 1):
                    s = l * l + i
                    g = tl.load(G + d[:, None] * (S * C) + s * C + c[None, :], mask=m2,
                                other=0.0).to(DT)  # fmt: skip
                    at = e * (S * 2 * NA) + s * (2 * NA) + t * NA + m
                    p = tl.load(P + at, mask=ok, other=0.0).to(DT)
                    acc += p[:, None] * g
                    tl.store(dP + at, tl.sum(y * g, 1) * w, mask=ok)
                dw += tl.sum(y * acc, 1)
                tl.store(dys + col, acc * w[:, None], mask=mc[None, :])
    tl.store(denv + e, dw * scale_hi + dw * scale_lo, mask=ok)


@triton.jit
def _gate_adjoint(dus, zs, dzs, F: tl.constexpr, NA: tl.constexpr, BE: tl.constexpr,
                  BN: tl.constexpr, DT: tl.constexpr):  # fmt: skip
    """``dz`` of a gated layer from ``du`` (its output's gradient) and its kept z:
    m >= 1: ``du s``; m = 0 sin: ``du``; m = 0 cos: ``du s + (du p + T) s (1 - s)``
    with ``p`` the m = 0 cos pre-activation, ``s = sigmoid(p)``, ``T = sum_{m >= 1}
    du_m z_m``."""
    rows = tl.arange(0, BE)
    for n0 in range(0, F, BN):
        at = rows[:, None] * F + (n0 + tl.arange(0, BN))[None, :]
        p = tl.load(zs + at)
        sg = tl.sigmoid(p)
        T = tl.zeros((BE, BN), DT)
        for mi in tl.static_range(NA):
            m = (mi + 1) % NA  # m = 1 .. NA - 1, then 0
            for tt in tl.static_range(2):
                t = 1 - tt  # sin, then cos
                off = (m * 2 + t) * (BE * F) + at
                du = tl.load(dus + off)
                if m > 0:
                    T += du * tl.load(zs + off)
                    dz = du * sg
                elif t == 1:
                    dz = du
                else:
                    dz = du * sg + (du * p + T) * (sg * (1 - sg))
                tl.store(dzs + off, dz)


@triton.jit
def _transposed(dzs, dus, res, w, RES: tl.constexpr, KIN: tl.constexpr,
                NOUT: tl.constexpr, NA: tl.constexpr, BE: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                DT: tl.constexpr):  # fmt: skip
    """``du[m] = W[m]^T dz[m] (+ res[m])``, scratch to scratch; ``W (NA, KIN,
    NOUT)`` as the forward has it (KIN outputs there), ``du`` NOUT wide."""
    rows = tl.arange(0, BE)
    for n0 in range(0, NOUT, BN):
        n = n0 + tl.arange(0, BN)
        for m in tl.static_range(NA):
            for t in tl.static_range(2):
                acc = _linear(dzs + (m * 2 + t) * (BE * KIN), w + m * KIN * NOUT, n0,
                              KIN, 1, NOUT, BE, BN, BK, PREC, DT)  # fmt: skip
                at = (m * 2 + t) * (BE * NOUT) + rows[:, None] * NOUT + n[None, :]
                if RES:
                    acc += tl.load(res + at)
                tl.store(dus + at, acc)


@triton.jit
def _rotate_adjoint(dxs, h, P, rho, s_re, s_rf, src, dst, e, ok, tile, dP, drho,
                    s_de, s_df, dh, part, dsrc, C, L: tl.constexpr,
                    NA: tl.constexpr, F: tl.constexpr, BE: tl.constexpr,
                    C2: tl.constexpr, DT: tl.constexpr):  # fmt: skip
    """From ``dx = dLoss/dx``: ``dA[e, s, c'] = sum_{t, m} P rho dx``, its dst half
    summed per segment (inner segments into ``dh``, the first and last into
    ``part[tile]``), its src half per edge into ``dsrc (E, S, C)``; ``dP += sum_c'
    rho dx A``; ``drho[e, f] = sum_{t, m} dx x0`` (x0: the rotation before rho)."""
    S: tl.constexpr = (L + 1) * (L + 1)
    rows = tl.arange(0, BE)
    cp = tl.arange(0, C2)
    mcp = cp < 2 * C
    m2 = ok[:, None] & mcp[None, :]
    d, last, hit, node = _segments(dst, e, ok, BE)
    onehot = tl.where(hit, 1.0, 0.0).to(DT)
    inner = (rows > 0) & (rows < last)
    node_s = tl.load(src + e, mask=ok, other=0)
    nd = tl.where((cp < C)[None, :], d[:, None], node_s[:, None])
    hrow = nd * (S * C) + (cp % C)[None, :]
    for l in tl.static_range(L + 1):
        f = cp * (L + 1) + l
        r = tl.load(rho + e[:, None] * s_re + f[None, :] * s_rf, mask=m2,
                    other=0.0).to(DT)  # fmt: skip
        dr = tl.zeros((BE, C2), DT)
        for m in tl.static_range(NA):
            for t in tl.static_range(2):
                dx = tl.load(dxs + (m * 2 + t) * (BE * F) + rows[:, None] * F
                             + f[None, :], mask=mcp[None, :], other=0.0)  # fmt: skip
                x0 = tl.zeros((BE, C2), DT)
                for i in tl.static_range(2 * l + 1):
                    s = l * l + i
                    a = tl.load(h + hrow + s * C, mask=m2, other=0.0).to(DT)
                    at = e * (S * 2 * NA) + s * (2 * NA) + t * NA + m
                    p = tl.load(P + at, mask=ok, other=0.0).to(DT)
                    x0 += p[:, None] * a
                    old = tl.load(dP + at, mask=ok, other=0.0)
                    tl.store(dP + at, old + tl.sum(r * dx * a, 1), mask=ok)
                dr += dx * x0
        tl.store(drho + e[:, None] * s_de + f[None, :] * s_df, dr, mask=m2)
        for i in tl.static_range(2 * l + 1):
            s = l * l + i
            dA = tl.zeros((BE, C2), DT)
            for m in tl.static_range(NA):
                for t in tl.static_range(2):
                    at = (m * 2 + t) * (BE * F) + rows[:, None] * F + f[None, :]
                    dx = tl.load(dxs + at, mask=mcp[None, :], other=0.0)
                    p = tl.load(P + e * (S * 2 * NA) + s * (2 * NA) + t * NA + m,
                                mask=ok, other=0.0).to(DT)  # fmt: skip
                    dA += p[:, None] * r * dx
            sums = tl.dot(onehot, dA, input_precision="ieee", out_dtype=DT)
            mine = (cp < C)[None, :]
            tl.store(dh + node[:, None].to(tl.int64) * (S * C) + s * C + cp[None, :],
                     sums, mask=inner[:, None] & mine)  # fmt: skip
            first = part + tl.cast(tile, tl.int64) * (2 * S * C) + s * C + cp
            tl.store(first, tl.sum(tl.where((rows == 0)[:, None], sums, 0.0), 0),
                     mask=cp < C)  # fmt: skip
            tl.store(first + S * C,
                     tl.sum(tl.where((rows == last)[:, None], sums, 0.0), 0),
                     mask=(cp < C) & (last > 0))  # fmt: skip
            tl.store(dsrc + e[:, None] * (S * C) + s * C + (cp - C)[None, :], dA,
                     mask=ok[:, None] & (cp >= C)[None, :] & mcp[None, :])  # fmt: skip


@triton.jit(do_not_specialize=["E", "n_tiles"])
def _edge_layer_bwd_kernel(
    G, h, P, rho, s_re, s_rf, env, src, dst, w_g, b_g, w_o, b_o, scratch,
    dh, part, dsrc, dP, drho, s_de, s_df, denv, scale_hi, scale_lo, E, n_tiles,
    C,
    L: tl.constexpr, NA: tl.constexpr, F: tl.constexpr, FO: tl.constexpr,
    K: tl.constexpr, HAS_BG: tl.constexpr, HAS_BO: tl.constexpr, BE: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, BNO: tl.constexpr, BKO: tl.constexpr,
    CP: tl.constexpr, C2: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr,
):  # fmt: skip
    """Tiles as the forward: the rotation and the stack again (keeping each gated
    layer's z and the output y), then the unrotation's adjoint, the stack's (output
    layer, then each gated layer's gate and product) and the rotation's."""
    pid = tl.program_id(0)
    X: tl.constexpr = NA * 2 * BE * F
    per: tl.constexpr = X * (4 + K) + NA * 2 * BE * FO * 2
    u0 = scratch + pid.to(tl.int64) * per
    u1 = u0 + X
    zk = u1 + X  # K of them
    du0 = zk + K * X
    du1 = du0 + X
    ys = du1 + X
    dys = ys + NA * 2 * BE * FO
    # [book: el-bwd]
    for tile in range(pid, n_tiles, tl.num_programs(0)):
        e0 = tl.cast(tile, tl.int64) * BE
        e = e0 + tl.arange(0, BE)
        ok = e < E
        _tile_forward(h, P, rho, s_re, s_rf, src, dst, e, ok, u0, u1, ys, zk, w_g,
                      b_g, w_o, b_o, C, L, NA, F, FO, K, HAS_BG, HAS_BO, BE, BN, BK,
                      BNO, PREC, DT, True)  # fmt: skip
        d = tl.load(dst + e, mask=ok, other=0)
        _unrotate_adjoint(ys, dys, P, env, G, d, e, ok, dP, denv, scale_hi, scale_lo,
                          C, L, NA, FO, BE, CP, DT)  # fmt: skip
        tl.debug_barrier()
        _transposed(dys, du0, du0, w_o, False, FO, F, NA, BE, BN, BKO, PREC, DT)
        tl.debug_barrier()
        for kk in tl.static_range(K):
            k = K - 1 - kk
            g = du0 if kk % 2 == 0 else du1  # the layer output's gradient
            o = du1 if kk % 2 == 0 else du0
            _gate_adjoint(g, zk + k * X, u1, F, NA, BE, BN, DT)  # u1: free now
            tl.debug_barrier()
            _transposed(u1, o, g, w_g + k * (NA * F * F), True, F, F, NA, BE, BN, BK,
                        PREC, DT)  # fmt: skip
            tl.debug_barrier()
        dx = du0 if K % 2 == 0 else du1
        _rotate_adjoint(dx, h, P, rho, s_re, s_rf, src, dst, e, ok, tile, dP, drho,
                        s_de, s_df, dh, part, dsrc, C, L, NA, F, BE, C2,
                        DT)  # fmt: skip
        tl.debug_barrier()
    # [/book: el-bwd]


@triton.jit
def _src_sum_kernel(ptr_src, perm_src, dsrc, dh, E, S: tl.constexpr, C,
                    SC: tl.constexpr):  # fmt: skip
    """Node n: ``dh[n] += sum`` of the src-side rows ``dsrc[e]`` of the edges that
    leave n, in the src-sorted order (deterministic)."""
    n = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, SC)
    mj = j < S * C
    lo = tl.load(ptr_src + n)
    hi = tl.load(ptr_src + n + 1)
    acc = tl.load(dh + n * (S * C) + j, mask=mj, other=0.0)
    for k in range(lo, hi):
        e = tl.load(perm_src + k)
        acc += tl.load(dsrc + e * (S * C) + j, mask=mj, other=0.0)
    tl.store(dh + n * (S * C) + j, acc, mask=mj)
