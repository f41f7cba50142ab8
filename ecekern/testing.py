"""Assertions shared by the tests and the book's check cells.

The book's correctness cells call these very functions, so what the reader sees
checked is what pytest checks.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "ATOL",
    "assert_close_three_way",
    "linear_args",
    "random_rotation",
    "rel_err",
    "rotated_atoms",
]

#: Absolute slack per dtype in the three-way rule (STYLE.md, "Tests").
ATOL = {
    torch.float64: 1e-12,
    torch.float32: 1e-6,
    torch.bfloat16: 1e-2,
    torch.float16: 1e-3,
}


def linear_args(B, K, O, n=3, dtype=torch.float32, device="cpu", seed=0):
    """``x (B, K, n)``, ``w (n, O, K)`` scaled by ``K^-1/2`` and ``b (O,)`` for one
    EquivariantLinear call: drawn in float64 from a seeded generator, then cast, so
    that every dtype and device sees the same values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, K, n, generator=g, dtype=torch.float64)
    w = torch.randn(n, O, K, generator=g, dtype=torch.float64) / K**0.5
    b = torch.randn(O, generator=g, dtype=torch.float64)
    return [t.to(device, dtype) for t in (x, w, b)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64 (``||a - b||`` when ``b`` is zero)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if a.shape != b.shape:
        raise AssertionError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    if not bool(torch.isfinite(a).all()):
        return math.inf
    den = torch.linalg.vector_norm(b)
    num = torch.linalg.vector_norm(a - b)
    return float(num / den) if den > 0 else float(num)


def assert_close_three_way(
    out: torch.Tensor,
    ref_same_dtype: torch.Tensor,
    ref_fp64: torch.Tensor,
    what: str = "",
) -> None:
    """``err(out) <= 2 * err(reference at the same dtype) + ATOL[dtype]``, errors
    measured against the float64 reference (flash-attention's rule)."""
    e_out = rel_err(out, ref_fp64)
    e_ref = rel_err(ref_same_dtype, ref_fp64)
    bound = 2 * e_ref + ATOL[out.dtype]
    if not e_out <= bound:
        raise AssertionError(
            f"{what}: relative error {e_out:.3e} > "
            f"2 x {e_ref:.3e} + {ATOL[out.dtype]:.0e}"
        )


def random_rotation(
    generator: torch.Generator | None = None, dtype=torch.float64
) -> torch.Tensor:
    """A uniformly random proper rotation ``(3, 3)`` (QR of a Gaussian matrix)."""
    a = torch.randn(3, 3, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    q = q * torch.sign(torch.diagonal(r))
    if torch.det(q) < 0:
        q[:, 0] = -q[:, 0]
    return q.to(dtype)


def rotated_atoms(atoms, rotation: torch.Tensor):
    """A copy of ``atoms`` with positions and cell rotated by ``rotation``."""
    R = rotation.detach().double().cpu().numpy()
    out = atoms.copy()
    out.set_cell(atoms.cell.array @ R.T, scale_atoms=False)
    out.positions = atoms.positions @ R.T
    return out
