"""The model's hyper-parameters: :class:`ECEConfig`, frozen and validated."""

from __future__ import annotations

import math
import numbers as _numbers
from dataclasses import asdict, dataclass

from .graph import MIN_DISTANCE

__all__ = ["MAX_CUTOFF", "ECEConfig"]

#: The longest cutoff an :class:`ECEConfig` accepts, in Angstrom: a local potential's
#: (the book's model has 5 A); longer ones make every atom a neighbour of every other.
MAX_CUTOFF = 100.0


@dataclass(frozen=True)
class ECEConfig:
    """Hyper-parameters of :class:`ECEModel`; the defaults are the book's model.

    Attributes:
        lmax: L, the largest degree, 1..6 (the model is tested at 1..4, the Wigner
            matrices and harmonics to 6).
        mmax: M <= L, the largest azimuthal order kept in the edge frame (None: L).
        channels: C, channels per spherical component.
        n_interactions: interaction layers (>= 1: only they make the energy depend on
            the geometry).
        n_gated: K, gated EquivariantLinear layers in each mixing stack.
        cutoff: r_c in Angstrom, from ``MIN_DISTANCE`` (0.1) to
            :data:`~ecekern.config.MAX_CUTOFF`.
        n_rbf: Bessel radial basis functions.
        radial_hidden: width of the radial MLP.
        readout_hidden: width of the per-atom energy MLP.
        avg_num_neighbors: k = 1/sqrt(avg_num_neighbors) normalises every neighbour sum
            (diamond at 5 A has about 90).
        species: the atomic numbers (1..118) the model knows, in embedding order.
        seed: the parameters are drawn from a generator seeded with this.
    """

    lmax: int = 2
    mmax: int | None = None
    channels: int = 32
    n_interactions: int = 2
    n_gated: int = 2
    cutoff: float = 5.0
    n_rbf: int = 8
    radial_hidden: int = 64
    readout_hidden: int = 32
    avg_num_neighbors: float = 90.0
    species: tuple[int, ...] = (1, 6, 7, 8)
    seed: int = 0

    def __post_init__(self):
        def pos_int(name, lo=1):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"ECEConfig.{name} must be an int >= {lo}, got {v!r}")

        for name in ("lmax", "channels", "n_rbf", "radial_hidden", "readout_hidden"):
            pos_int(name)
        pos_int("n_gated", 0)
        pos_int("n_interactions", 0)
        pos_int("seed", 0)
        if self.n_interactions == 0:
            raise ValueError(
                "ECEConfig.n_interactions must be >= 1, got 0: the energy is read from "
                "the invariant features h[:, 0], which only an interaction layer makes "
                "depend on the geometry (with none, E depends on the species alone)"
            )
        if self.lmax > 6:
            raise ValueError(
                f"ECEConfig.lmax={self.lmax} is beyond the tested range (<= 6)"
            )
        if self.mmax is not None and not (
            isinstance(self.mmax, int)
            and not isinstance(self.mmax, bool)
            and 0 <= self.mmax <= self.lmax
        ):
            raise ValueError(f"ECEConfig.mmax must be in [0, lmax], got {self.mmax!r}")
        cutoff = self.cutoff
        if (
            isinstance(cutoff, bool)
            or not isinstance(cutoff, _numbers.Real)
            or not MIN_DISTANCE <= cutoff <= MAX_CUTOFF
        ):
            raise ValueError(
                f"ECEConfig.cutoff must be a number of Angstrom from {MIN_DISTANCE} to "
                f"{MAX_CUTOFF:g} (a local potential; the book's model has 5), got "
                f"{cutoff!r}"
            )
        object.__setattr__(self, "cutoff", float(cutoff))
        k = self.avg_num_neighbors
        if isinstance(k, bool) or not (
            isinstance(k, _numbers.Real) and 0 < k < math.inf
        ):
            raise ValueError(
                f"ECEConfig.avg_num_neighbors must be a positive finite number, got "
                f"{k!r}"
            )
        try:
            species = tuple(self.species)
        except TypeError:
            raise TypeError(
                f"ECEConfig.species must be a sequence of atomic numbers, got "
                f"{self.species!r}"
            ) from None
        if (
            len(species) == 0
            or len(set(species)) != len(species)
            or not all(
                isinstance(z, _numbers.Integral)
                and not isinstance(z, bool)
                and 1 <= z <= 118
                for z in species
            )
        ):
            raise ValueError(
                "ECEConfig.species must be distinct atomic numbers from 1 to 118, got "
                f"{self.species!r}"
            )
        object.__setattr__(self, "species", tuple(int(z) for z in species))

    @property
    def M(self) -> int:
        return self.lmax if self.mmax is None else self.mmax

    @property
    def S(self) -> int:
        return (self.lmax + 1) ** 2

    @property
    def n_ang(self) -> int:
        return self.M + 1

    @property
    def F(self) -> int:
        """Feature rows of the angular layout, 2C(L+1)."""
        return 2 * self.channels * (self.lmax + 1)

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.avg_num_neighbors)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ECEConfig:
        """The config of :meth:`to_dict`'s dict; an unknown key is a ValueError."""
        if unknown := sorted(set(d) - set(cls.__dataclass_fields__)):
            raise ValueError(f"unknown ECEConfig fields {unknown} (a newer ecekern's?)")
        return cls(**d)
