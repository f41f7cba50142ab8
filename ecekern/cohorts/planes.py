"""Rows and planes for the layer kernels (:mod:`ecekern.cohorts.layers`).

The kernels read and write *planes* ``(n_ang, 2, E, W)`` (order, cos/sin, edge,
feature), the rows of a product contiguous. The stack's rows ``(E, W, n_ang)`` are
either a *planes pair*, the cos and sin views ``P[:, 0]``, ``P[:, 1]`` of one such
``P`` (chapter 3's ``planes=True``), read and written in place, or any other
strides, copied into planes buffers a cohort at a time and back. Cohorts: row
ranges of at most ``cohort_edges``, whose buffers are reused.
"""

from __future__ import annotations

import numbers

import torch

from .._planes import as_planes as _as_planes
from .._planes import planes_pair as _planes_pair


def _planes(p):
    """``(p, stride_m, stride_c)`` of planes ``(n_ang, 2, rows, width)``, rows
    contiguous."""
    return (p, p.stride(0), p.stride(1))


def _cohorts(E: int, cohort_edges: int):
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


def _rows_in(P, a, b, buf, a_cos, a_sin, sin0: bool):
    """Rows a..b as planes: a view of ``P`` when the rows are a planes pair
    (:func:`_as_planes`), else copied into ``buf`` (:func:`_in`)."""
    if P is not None:
        return P[:, :, a:b]
    return _in(buf, a_cos[a:b], a_sin[a:b], sin0)


def _out(buf, n, o_cos, o_sin, sin0: bool):
    """The first n rows of planes ``buf`` out into rows ``(n, F, n_ang)`` (with
    ``sin0``, zeros for the m = 0 sin plane, which the kernels did not write)."""
    o_cos.copy_(buf[:, 0, :n].permute(1, 2, 0))
    o_sin[..., int(sin0) :].copy_(buf[int(sin0) :, 1, :n].permute(1, 2, 0))
    if sin0:
        o_sin[..., 0].zero_()


def _grad_layouts(g_cos, g_sin, E, F, n_ang):
    """``(gP, dxP, dx_cos, dx_sin)``: an output gradient that is a planes pair is
    read in place (``gP``) and dx made a planes pair (``dxP``) for the next kernel
    to read in place; else both None and dx contiguous rows."""
    gP = _as_planes(g_cos, g_sin)
    if gP is None:
        dx_cos = g_cos.new_empty((E, F, n_ang))
        return None, None, dx_cos, torch.empty_like(dx_cos)
    return (gP, *_planes_pair(g_cos, E, F, n_ang))


def _backward_buffers(like, n_ang, c, F, FO):
    """One cohort's planes for the backward, reused from cohort to cohort: the
    output gradient ``gp`` and two each of ``du`` and ``dz``."""
    gp = like.new_empty((n_ang, 2, c, FO))
    du = [like.new_empty((n_ang, 2, c, F)) for _ in range(2)]
    dz = [like.new_empty((n_ang, 2, c, F)) for _ in range(2)]
    return gp, du, dz
