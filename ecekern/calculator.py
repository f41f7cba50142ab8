"""An ASE calculator for :class:`ecekern.ECEModel`: energy, forces and stress.

``ECECalculator(model)`` plugs the model into ASE (``atoms.calc = ...``), so ASE's
molecular dynamics, optimisers and equations of state run on it. Every
:meth:`~ECECalculator.calculate` rebuilds the neighbour list
(:func:`ecekern.graph.build_graph` at ``model.config.cutoff``) and runs one forward and
one backward: forces and stress come from a single ``torch.autograd.grad`` with respect
to the positions and a strain together.

Stress (periodic cells only). A symmetric strain ``eps`` (3x3, zero, differentiated)
deforms positions and cell alike, ``x' = x (I + eps)`` and ``cell' = cell (I + eps)``;
the graph's integer shifts stay fixed, so every edge vector
``r_e = x_src + shift_e @ cell - x_dst`` follows the strain exactly,
``r_e' = r_e (I + eps)``. Then::

    sigma_ij = (1 / V) dE/d eps_ij   at eps = 0,   V = |det(cell)|,

which is ASE's convention (``atoms.get_stress()``: positive under tension, i.e. when
stretching the cell raises the energy; the same as ASE's finite difference
``ase.calculators.fd.calculate_numerical_stress`` with
``atoms.set_cell(cell @ (I + eps), scale_atoms=True)``), returned as ASE's Voigt
6-vector ``(xx, yy, zz, yz, xz, xy)``.

Units: energy and free energy eV (Python floats, equal: the model has no electronic
entropy), forces eV/A (``(N, 3)`` float64 numpy), stress eV/A^3 (``(6,)`` float64
numpy; multiply by ``1 / ase.units.GPa`` for GPa).
"""

from __future__ import annotations

import numpy as np
import torch
from ase.calculators.calculator import (
    Calculator,
    PropertyNotImplementedError,
    all_changes,
)

from .graph import build_graph, with_cell
from .graph_step import GraphStep
from .graph_step import strained as _strained
from .model import unwrap

__all__ = ["ECECalculator"]

_VOIGT = ((0, 0), (1, 1), (2, 2), (1, 2), (0, 2), (0, 1))  # xx yy zz yz xz xy


class ECECalculator(Calculator):
    """ASE calculator running an :class:`ecekern.ECEModel`.

    Args:
        model: the :class:`~ecekern.ECEModel`. The constructor moves it, in place (as
            ``nn.Module.to`` does), to ``device``; and, only when ``dtype`` is given
            and differs from the model's, to ``dtype`` (once, here). The calculator
            never converts it afterwards: if the model's dtype or device changes later,
            ``calculate()`` raises a ValueError naming the fix
            (``model.to(dtype)`` / ``model.to(device)``). ``torch.compile(model)``
            works too: the compiled module computes, the ECEModel inside it gives
            the config and is the one moved.
        device: where to compute; default ``"cuda"`` when ``torch.cuda.is_available()``,
            else ``"cpu"``. ``"meta"`` (no data) is a ValueError.
        dtype: ``torch.float32`` or ``torch.float64``; default the dtype of the model's
            parameters (``ECEModel`` is built in float32; ``model.double()`` for
            float64, which is what long NVE runs want).
        graph_step: run each step as a replayed CUDA graph
            (:class:`~ecekern.graph_step.GraphStep`, chapter 4): the neighbour list
            is stored up to an edge capacity with headroom and the graph is captured
            again only when a step exceeds it. Same energies and forces as without
            (to rounding); on a device without CUDA graphs the same padded step
            runs eagerly, after a :class:`~ecekern.options.FallbackWarning`.
            Default (None): replayed on CUDA for an ``ECEModel`` (the eager step is
            host-bound there at small sizes), eager elsewhere and for a
            ``torch.compile``d model; ``False`` asks for the eager step.
        **kwargs: passed to ASE's ``Calculator``
            (``label``, ``directory``, ...).

    Properties (see the module docstring for the stress formula): ``energy`` and
    ``free_energy`` (eV), ``forces = -dE/dx`` (eV/A), ``stress`` (eV/A^3, Voigt
    ``xx, yy, zz, yz, xz, xy``; only when a direction is periodic: a non-periodic
    system raises ASE's ``PropertyNotImplementedError``).
    Asking for any property computes energy, forces and (periodic cells) stress in one
    forward and one backward; ASE caches them until the atoms change
    (``check_state``: positions, numbers, cell, pbc).

    Example, NVE molecular dynamics (64 atoms, seconds on a CPU)::

        import numpy as np
        from ase import units
        from ase.md.velocitydistribution import thermalize_momenta
        from ase.md.verlet import VelocityVerlet

        import ecekern
        from ecekern.calculator import ECECalculator

        cfg = ecekern.ECEConfig(channels=4, n_gated=1, cutoff=3.0)
        model = ecekern.ECEModel(cfg).double()
        atoms = ecekern.systems.diamond(repeats=2)  # 64 carbon atoms
        atoms.calc = ECECalculator(model)  # ECECalculator(model, device="cuda")
        thermalize_momenta(atoms, 300, rng=np.random.default_rng(0))
        VelocityVerlet(atoms, timestep=1.0 * units.fs).run(20)
        print(atoms.get_total_energy(), atoms.get_stress())  # eV, eV/A^3

    (``thermalize_momenta`` is ASE 3.29's name for ``MaxwellBoltzmannDistribution``.)
    """

    implemented_properties = ["energy", "free_energy", "forces", "stress"]
    default_parameters: dict = {}

    def __init__(self, model, device=None, dtype=None, graph_step=None, **kwargs):
        """See the class docstring: ``model``, ``device``, ``dtype``, ``graph_step``
        and ASE's ``**kwargs``."""
        module = unwrap(model)  # an ECEModel, or torch.compile of one
        model_dtype = next(module.parameters()).dtype
        if next(module.parameters()).is_meta:
            raise ValueError(
                "the model's parameters are on the meta device (shapes, no values): "
                "load them first, e.g. ECEModel.load(path)"
            )
        if dtype is None:
            dtype = model_dtype
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(
                f"dtype must be torch.float32 or torch.float64, got {dtype!r}"
            )
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        if device.type == "meta":  # tensors without storage: nothing to compute on
            raise ValueError(
                f"device={str(device)!r} holds no data (a meta tensor has a shape "
                "and no values): give a device that computes, e.g. 'cpu' or 'cuda'"
            )
        if graph_step is not None and not isinstance(graph_step, bool):
            # every check before the model changes
            raise TypeError(f"graph_step must be a bool or None, got {graph_step!r}")
        if graph_step is None:
            graph_step = device.type == "cuda" and module is model
        super().__init__(**kwargs)
        if dtype != model_dtype:  # only reachable with an explicit dtype
            module.to(dtype=dtype)
        module.to(device=device)
        self.model = model  # what computes; unwrap(self.model): config and checks
        self.dtype = dtype
        self.device = next(module.parameters()).device  # "cuda" -> "cuda:0"
        self.graph_step = graph_step
        self._step: GraphStep | None = None  # kept while the atoms' numbers stay
        self._step_key = None

    def _check_model(self) -> None:
        p = next(unwrap(self.model).parameters())
        if p.dtype != self.dtype:
            raise ValueError(
                f"the model is now {p.dtype} but this calculator computes in "
                f"{self.dtype}; call model.to({self.dtype}) or build a new "
                f"ECECalculator(model, dtype={p.dtype})"
            )
        if p.device != self.device:
            raise ValueError(
                f"the model is now on {p.device} but this calculator computes on "
                f"{self.device}; call model.to('{self.device}') or build a new "
                f"ECECalculator(model, device='{p.device}')"
            )

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
        """Energy, forces and (any pbc True) stress of ``atoms`` into
        ``self.results``; one neighbour list, one forward, one backward."""
        super().calculate(atoms, properties, system_changes)
        atoms = self.atoms
        periodic = bool(np.any(atoms.pbc))
        if "stress" in properties and not periodic:
            raise PropertyNotImplementedError(
                "stress needs a periodic cell (pbc True in at least one direction); "
                f"these atoms have pbc={atoms.pbc.tolist()}"
            )
        self._check_model()
        kw = dict(dtype=self.dtype, device=self.device)
        positions = torch.as_tensor(atoms.get_positions(), **kw)
        cell = torch.as_tensor(atoms.cell.array, **kw)
        numbers = torch.as_tensor(atoms.numbers, dtype=torch.long, device=self.device)
        cutoff = unwrap(self.model).config.cutoff
        graph = build_graph(positions, cell, atoms.pbc, cutoff)
        if self.graph_step:
            e, grads = self._graph_step(positions, numbers, graph, periodic)
        else:
            e, grads = self._eager_step(positions, numbers, graph, cell, periodic)
        self.results = {
            "energy": e,
            "free_energy": e,
            "forces": -grads[0].detach().cpu().double().numpy(),
        }
        volume = abs(atoms.cell.volume)
        if periodic and volume > 0:
            virial = grads[1].detach().cpu().double().numpy()  # dE/d eps, eV
            sigma = 0.5 * (virial + virial.T) / volume
            self.results["stress"] = np.array([sigma[i, j] for i, j in _VOIGT])
        elif "stress" in properties:  # a slab or wire whose open direction has no
            raise PropertyNotImplementedError(  # cell vector: no volume
                "stress needs a cell of non-zero volume: give the non-periodic "
                "directions a cell vector too (e.g. atoms.center(vacuum=10))"
            )

    def _graph_step(self, positions, numbers, graph, periodic):
        # a new step for new atoms, another model, or the model in another dtype
        key = (tuple(self.atoms.numbers.tolist()), periodic, self.dtype, self.device)
        stale = self._step is None or self._step.model is not self.model
        if stale or key != self._step_key:
            self._step = GraphStep(self.model, numbers, stress=periodic, graphs=True)
            self._step_key = key
        out = self._step(positions, graph)
        grads = [-out.forces] + ([out.virial] if periodic else [])
        return float(out.energy), grads

    def _eager_step(self, positions, numbers, graph, cell, periodic):
        kw = dict(dtype=self.dtype, device=self.device)
        with torch.inference_mode(False), torch.enable_grad():
            x = positions.detach().requires_grad_(True)
            wrt = [x]
            if periodic:
                eps = torch.zeros(3, 3, **kw, requires_grad=True)
                wrt.append(eps)
                # shifts stay integer and fixed: r_e' = r_e (I + eps) exactly
                graph = with_cell(graph, _strained(cell, eps))
                energy = self.model(_strained(x, eps), numbers, graph)
            else:
                energy = self.model(x, numbers, graph)
            if energy.requires_grad:
                grads = torch.autograd.grad(energy, wrt, allow_unused=True)
            else:  # no parameter needs grad and no edge: E does not depend on x
                grads = (None,) * len(wrt)
        grads = [torch.zeros_like(t) if g is None else g for t, g in zip(wrt, grads)]
        return float(energy.detach()), grads
