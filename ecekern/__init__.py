"""ecekern: an SO(2)-edge-frame equivariant interatomic potential, made fast on a GPU
kernel by kernel.

Glossary: N atoms, E edges (``src -> dst``), C channels, L = lmax, M = mmax,
S = (L+1)^2 spherical components, n_ang = M+1 angular slots, F = 2C(L+1) feature rows,
P angular slots of a packed layout.

Quick start::

    import ecekern
    atoms = ecekern.systems.diamond(repeats=2)
    model = ecekern.ECEModel(ecekern.ECEConfig())
    energy, forces = ecekern.energy_and_forces(model, atoms)
    model.save("model.pt")  # ecekern.ECEModel.load("model.pt") reads it back
"""

from . import checkpoint, options, reference, so3, systems
from .graph import Graph, build_graph, neighbor_list
from .graph_step import GraphStep
from .linear import EquivariantLinear
from .model import ECEConfig, ECEModel, energy_and_forces
from .plan import StepPlan, plan_for
from .zonal import zonal_scatter

__version__ = "0.1.0"


def __getattr__(name):  # the ASE calculator imports ASE's machinery on first use
    if name == "ECECalculator":
        from .calculator import ECECalculator

        return ECECalculator
    raise AttributeError(f"module 'ecekern' has no attribute {name!r}")


__all__ = [
    "ECECalculator",
    "ECEConfig",
    "ECEModel",
    "EquivariantLinear",
    "Graph",
    "GraphStep",
    "StepPlan",
    "build_graph",
    "checkpoint",
    "energy_and_forces",
    "neighbor_list",
    "options",
    "plan_for",
    "reference",
    "so3",
    "systems",
    "zonal_scatter",
]
