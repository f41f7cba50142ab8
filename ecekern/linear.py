"""EquivariantLinear: ``y[e, o, m] = sum_i x[e, i, m] W[m, o, i]`` (+ bias, m = 0 cos).

The layer owns the parameters ``weight (n_ang, out, in)`` and ``bias (out,)``, the
same for every implementation path, so a ``state_dict`` loads across paths unchanged.
This version has the reference path (``"einsum"``, the reference
``equivariant_linear``); chapter 2 adds the fast paths. A path that cannot serve a
call falls back to the reference loudly (:func:`ecekern.options.fallback`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from . import options, reference

__all__ = ["EquivariantLinear", "equivariant_linear"]

_BUILT_PATHS = ("einsum",)


def equivariant_linear(x_cos, x_sin, weight, bias, path: str = "auto"):
    """Computes the same as :func:`ecekern.reference.equivariant_linear`.

    ``path`` names the implementation; ``"auto"`` takes the process-wide option
    (:class:`ecekern.options.Options`, field ``linear``).
    """
    if path == "auto":
        path = options.current().linear
    if path not in options.LINEAR_PATHS:
        raise ValueError(f"path must be one of {options.LINEAR_PATHS}, got {path!r}")
    if path not in _BUILT_PATHS and path != "auto":
        options.fallback(
            "equivariant_linear", f"path {path!r} is not built in this version"
        )
    return reference.equivariant_linear(x_cos, x_sin, weight, bias)


class EquivariantLinear(nn.Module):
    """SO(2)-equivariant linear map of the angular layout, ``(..., in, n_ang)`` pairs.

    Commutes with rotations about the edge axis: the same ``W[m]`` acts on the cos
    and sin parts of order m; the bias enters only the m = 0 cos slot.
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
        if path not in options.LINEAR_PATHS:
            raise ValueError(
                f"path must be one of {options.LINEAR_PATHS}, got {path!r}"
            )
        self.in_features, self.out_features, self.n_ang = (
            in_features,
            out_features,
            n_ang,
        )
        self.path = path
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
