"""What chapter 6's two kernel families share: the layer kernels
(:mod:`ecekern.stack_layers`) and the fused stack (:mod:`ecekern.stack_fused`) import
this, never each other, and :mod:`ecekern.cohorts` runs either.

* Precisions, one naming for callers (:data:`PRECISIONS`): ``"fp32"`` (strict fp32
  FMA; also the name for float64 rows), ``"3xtf32"`` (fp32-accurate, ``hi lo + lo
  hi + hi hi`` in three TF32 products), ``"tf32"``, ``"bf16"`` (operands rounded to
  bfloat16, fp32 sums); :func:`kernel_precision` maps them to the kernels' own
  names (``tl.dot``'s ``"ieee"``, ``"tf32x3"``, ...), here and nowhere else.
* The stack's rows and planes: rows ``(E, W, n_ang)`` (cos, sin) are either a
  *planes pair*, the views ``P[:, 0]``, ``P[:, 1]`` of one ``P (n_ang, 2, E, W)``
  (order, cos/sin, edge, feature; :mod:`ecekern._planes`), read and written in
  place, or copied into planes buffers a cohort at a time and back. Cohorts: row
  ranges of at most ``cohort_edges`` (:data:`COHORT_EDGES` unless told), whose
  buffers are reused.
* The launchers' checks: a shape, device or dtype that would send a kernel out of
  bounds is a clear error before any launch.
* :func:`split_tf32`: a weight's TF32 part and remainder, for ``"3xtf32"``.

Status: host code only (PyTorch), used by both kernel families' launchers.
"""

from __future__ import annotations

import numbers

import torch

from ._planes import as_planes, planes_pair

__all__ = ["COHORT_EDGES", "PRECISIONS", "kernel_precision", "split_tf32"]

#: Rows (edges) per cohort unless told otherwise: the scratch of the stack's
#: backward, and the kernels' planes buffers, hold this many.
COHORT_EDGES = 65536
#: The precisions of the kernels' products, as callers name them.
PRECISIONS = ("fp32", "3xtf32", "tf32", "bf16")
#: Each caller's name -> the kernels' (``tl.dot``'s input precisions, and bf16).
_KERNEL_NAMES = {"fp32": "ieee", "3xtf32": "tf32x3", "tf32": "tf32", "bf16": "bf16"}


def kernel_precision(precision: str) -> str:
    """The kernels' name of a caller's precision (:data:`PRECISIONS`): ``"fp32"``
    -> ``"ieee"``, ``"3xtf32"`` -> ``"tf32x3"``, ``"tf32"``, ``"bf16"``; a
    ValueError for any other."""
    if not isinstance(precision, str) or precision not in _KERNEL_NAMES:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return _KERNEL_NAMES[precision]


def split_tf32(w: torch.Tensor) -> torch.Tensor:
    """``(2, *w.shape)``: w rounded to TF32 (nearest, ties to even) and the
    remainder ``w - hi`` (exact in fp32), contiguous; the weights' form in
    ``"3xtf32"``, split once a call instead of in every program (float32 only;
    finite values: an infinite weight has no TF32 remainder)."""
    if w.dtype != torch.float32:
        raise TypeError(f"split_tf32 takes float32 weights, got {w.dtype}")
    b = w.detach().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    b = (b + 0xFFF + ((b >> 13) & 1)) & 0xFFFFE000
    hi = torch.where(b >= 2**31, b - 2**32, b).to(torch.int32).view(torch.float32)
    return torch.stack((hi, w.detach() - hi))


# --------------------------------------------------------------------------------------
# rows, planes and cohorts
# --------------------------------------------------------------------------------------
def planes(p):
    """``(p, stride_m, stride_c)`` of planes ``(n_ang, 2, rows, width)``, rows
    contiguous."""
    return (p, p.stride(0), p.stride(1))


def cohort_spans(E: int, cohort_edges: int):
    """``(a, b)`` row ranges of at most ``cohort_edges`` rows."""
    if isinstance(cohort_edges, bool) or not isinstance(cohort_edges, numbers.Integral):
        raise TypeError(f"cohort_edges must be an int, got {cohort_edges!r}")
    if cohort_edges < 1:
        raise ValueError(f"cohort_edges must be at least 1, got {cohort_edges}")
    c = int(cohort_edges)
    return [(a, min(a + c, E)) for a in range(0, E, c)]


def _in(buf, a_cos, a_sin, sin0: bool):
    """Rows ``(n, F, n_ang)`` into the first n rows of planes ``buf`` (with ``sin0``
    not the m = 0 sin plane, which the kernels then never read)."""
    n = a_cos.shape[0]
    buf[:, 0, :n].copy_(a_cos.permute(2, 0, 1))
    buf[int(sin0) :, 1, :n].copy_(a_sin[..., int(sin0) :].permute(2, 0, 1))
    return buf[:, :, :n]


def rows_in(P, a, b, buf, a_cos, a_sin, sin0: bool):
    """Rows a..b as planes: a view of ``P`` when the rows are a planes pair
    (:func:`ecekern._planes.as_planes`), else copied into ``buf``."""
    if P is not None:
        return P[:, :, a:b]
    return _in(buf, a_cos[a:b], a_sin[a:b], sin0)


def rows_out(buf, n, o_cos, o_sin, sin0: bool):
    """The first n rows of planes ``buf`` out into rows ``(n, F, n_ang)`` (with
    ``sin0``, zeros for the m = 0 sin plane, which the kernels did not write)."""
    o_cos.copy_(buf[:, 0, :n].permute(1, 2, 0))
    o_sin[..., int(sin0) :].copy_(buf[int(sin0) :, 1, :n].permute(1, 2, 0))
    if sin0:
        o_sin[..., 0].zero_()


def out_layout(x_cos, x_sin, E, W, n_ang):
    """``(xP, yP, y_cos, y_sin)``: rows that are a planes pair are read in place
    (``xP``) and the output made a planes pair (``yP``, width W) for the next
    kernel to read in place; else both None and the output contiguous rows. The
    forward's x and y, and the backward's dy and dx, alike."""
    xP = as_planes(x_cos, x_sin)
    if xP is None:
        y_cos = x_cos.new_empty((E, W, n_ang))
        return None, None, y_cos, torch.empty_like(y_cos)
    return (xP, *planes_pair(x_cos, E, W, n_ang))


# --------------------------------------------------------------------------------------
# the launchers' checks
# --------------------------------------------------------------------------------------
def check(name: str, t, shape: tuple, device) -> None:
    """A clear error where a shape or device would send a kernel out of bounds."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(
            f"{name} must be a tensor of shape {shape}, got {type(t).__name__}"
        )
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} is {tuple(t.shape)}, expected {shape}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the rows on {device}")


def flags(**named) -> None:
    """A TypeError for a flag that is not a bool (``sin0_zero=2`` would skip a
    plane the kernels then read)."""
    for name, v in named.items():
        if not isinstance(v, bool):
            raise TypeError(f"{name} must be a bool, got {v!r}")


def checked(x_cos, weights, weight_out, dtype, why_not, who: str):
    """``(n_ang, F', F)`` after the checks every launcher shares (``x_cos``: the
    first rows, ``(E, width, n_ang)``); ``why_not(x_cos, weight_out)``: why the
    kernels (``who``) cannot serve the call, or None."""
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
    why = why_not(x_cos, weight_out)
    if why:
        raise ValueError(f"{who} cannot serve this call: {why}")
    n_ang, FO, F = weight_out.shape
    named = [*((f"weights[{k}]", w) for k, w in enumerate(weights)),
             ("weight_out", weight_out)]  # fmt: skip
    for name, wt in named:
        shape = (n_ang, F if name != "weight_out" else FO, F)
        if isinstance(wt, torch.Tensor) and tuple(wt.shape) != shape:  # F: W_out's
            wo = tuple(weight_out.shape)
            raise ValueError(f"{name} is {tuple(wt.shape)}, expected {shape} "
                             f"(F = {F}, from weight_out {wo})")  # fmt: skip
        check(name, wt, shape, x_cos.device)
        if wt.dtype != dtype:
            raise TypeError(f"{name} has dtype {wt.dtype} but the rows have {dtype}")
    return n_ang, FO, F


def check_rows(E, F, n_ang, dev, dt, **rows):
    """Each named tensor is rows ``(E, F, n_ang)`` on ``dev`` of dtype ``dt``."""
    for name, t in rows.items():
        check(name, t, (E, F, n_ang), dev)
        if t.dtype != dt:
            raise TypeError(f"{name} has dtype {t.dtype}, the weights {dt}")


def check_biases(biases, bias_out, K, F, FO, dev, dt):
    """K gated layers' biases ``(F,)`` or None, and the output layer's ``(F',)``
    or None, on ``dev`` of dtype ``dt``."""
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
            check(name, bk, (F if k < K else FO,), dev)
            if bk.dtype != dt:
                raise TypeError(f"{name} has dtype {bk.dtype} but the rows have {dt}")


def backward_setup(g_cos, g_sin, weights, weight_out, precision, dt, E, checked):
    """``(n_ang, F', F)`` of a backward launcher's call after its family's checks
    (``checked``: the launchers' shared checks, with that family's ``why_not``) and
    the output gradient's rows."""
    n_ang, FO, F = checked(g_cos, weights, weight_out, precision, dt)
    check_rows(E, FO, n_ang, g_cos.device, dt, g_cos=g_cos, g_sin=g_sin)
    return n_ang, FO, F


def check_kept_z(z, K: int, n_ang: int, E: int, F: int, device) -> None:
    """The kept pre-activations' shape ``(K, n_ang, 2, E, F)`` and layout, as the
    forward launchers return them (contiguous)."""
    check("z", z, (K, n_ang, 2, E, F), device)
    if not z.is_contiguous():
        raise ValueError("z must be contiguous, as stack_forward returns it")


def check_z(z, g_cos, K: int):
    """The kept pre-activations' type, dtype (the output gradient's, ``g_cos``) and
    layer count (their shape is checked once the widths are known)."""
    if not isinstance(z, torch.Tensor):
        raise TypeError("z must be the pre-activations stack_forward kept (keep=True),"
                        f" got {z!r:.60}")  # fmt: skip
    if not isinstance(g_cos, torch.Tensor):
        raise TypeError(f"g_cos must be an (E, F', n_ang) tensor, got {g_cos!r:.60}")
    if z.dtype != g_cos.dtype:
        raise TypeError(f"z has dtype {z.dtype}, the output gradient {g_cos.dtype}")
    if z.ndim == 5 and z.shape[0] != K:
        raise ValueError(f"z holds {z.shape[0]} layers' pre-activations, {K} weights")
