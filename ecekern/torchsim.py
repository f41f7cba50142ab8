"""An ECEModel as a TorchSim model: molecular dynamics with the host out of the loop.

``ECETorchSimModel(model)`` is a ``torch_sim.models.interface.ModelInterface``
(torch-sim-atomistic): ``forward(state)`` takes a ``SimState`` (or its dict) of one
or more systems and returns::

    energy  (n_systems,)        eV
    forces  (n_atoms, 3)        eV/A, -dE/dx
    stress  (n_systems, 3, 3)   eV/A^3, (1/V) dE/d eps symmetrised (ASE's sign)

TorchSim keeps the state on the device and integrates there; each step calls this
model once. Per system: the neighbour list on the state's device (vesin-torch, the
library's ``build_graph``), then the force step, replayed as a CUDA graph
(:class:`~ecekern.graph_step.GraphStep`, one per system, kept while its atomic
numbers stay) on CUDA and eager elsewhere, with the step plan of the options in
force. The systems of a batch run one after another (a batch is a list of graphs,
as in TorchSim's own pair potentials).

Status: energies, forces and stress; periodic systems and open ones (a pbc False
state has no stress); float32 and float64 (the model's dtype). Tested on the CPU
against :class:`~ecekern.ECECalculator`, and by an NVE run through TorchSim's
integrator.
"""

from __future__ import annotations

import torch
import torch_sim as ts
from torch_sim.models.interface import ModelInterface

from .graph import build_graph, with_cell
from .graph_step import GraphStep, strained
from .model import ECEModel

__all__ = ["ECETorchSimModel"]


class ECETorchSimModel(ModelInterface):
    """``model`` (an :class:`~ecekern.ECEModel`, on its device, in its dtype) as a
    TorchSim model. ``compute_stress``: also the stress (periodic states only).
    ``graph_step``: replay each system's step as a CUDA graph (default: on CUDA)."""

    def __init__(self, model: ECEModel, compute_stress: bool = True,
                 graph_step: bool | None = None):  # fmt: skip
        super().__init__()
        if not isinstance(model, ECEModel):
            raise TypeError(
                f"model must be an ecekern.ECEModel, got {type(model).__name__}"
            )
        p = next(model.parameters())
        if p.dtype not in (torch.float32, torch.float64):
            raise TypeError(
                f"the model is {p.dtype}: call model.float() or model.double() first"
            )
        if graph_step is not None and not isinstance(graph_step, bool):
            raise TypeError(f"graph_step must be a bool or None, got {graph_step!r}")
        self.model = model
        self._device, self._dtype = p.device, p.dtype
        self._compute_stress, self._compute_forces = bool(compute_stress), True
        self._memory_scales_with = "n_atoms_x_density"
        self.graph_step = p.device.type == "cuda" if graph_step is None else graph_step
        self._steps: dict[int, tuple[tuple, GraphStep]] = {}

    def forward(self, state, **kwargs) -> dict[str, torch.Tensor]:
        """Energy, forces and (``compute_stress``, periodic) stress of every system
        of ``state`` (module docstring)."""
        if not isinstance(state, ts.SimState):
            state = ts.SimState(**state)
        for name in ("positions", "cell"):
            t = getattr(state, name)
            if t.dtype != self._dtype or t.device != self._device:
                raise ValueError(
                    f"state.{name} is {t.dtype} on {t.device}; the model computes in "
                    f"{self._dtype} on {self._device}: build the state there"
                )
        pbc = state.pbc
        pbc = (
            [bool(v) for v in pbc.tolist()] if torch.is_tensor(pbc) else [bool(pbc)] * 3
        )
        if self._compute_stress and not any(pbc):
            raise ValueError("stress needs a periodic state: compute_stress=False")
        counts = torch.bincount(state.system_idx, minlength=state.n_systems).tolist()
        cells = state.row_vector_cell  # (n_systems, 3, 3), ASE's rows
        energies, forces, stresses = [], [], []
        start = 0
        for b, n in enumerate(counts):
            x = state.positions[start : start + n]
            numbers = state.atomic_numbers[start : start + n].long()
            start += n
            e, f, virial = self._system(b, x, numbers, cells[b], pbc)
            energies.append(e)
            forces.append(f)
            if self._compute_stress:
                volume = torch.linalg.det(cells[b]).abs()
                stresses.append(0.5 * (virial + virial.T) / volume)
        out = {"energy": torch.stack(energies), "forces": torch.cat(forces)}
        if self._compute_stress:
            out["stress"] = torch.stack(stresses)
        return out

    def _system(self, b: int, x, numbers, cell, pbc):
        """``(energy, forces, virial or None)`` of one system."""
        graph = build_graph(x, cell, pbc, self.model.config.cutoff)
        stress = self._compute_stress
        if self.graph_step:
            key = (tuple(numbers.tolist()), stress)
            kept = self._steps.get(b)
            if kept is None or kept[0] != key:
                kept = (key, GraphStep(self.model, numbers, stress=stress))
                self._steps[b] = kept
            r = kept[1](x, graph)
            return r.energy, r.forces, r.virial
        with torch.inference_mode(False), torch.enable_grad():
            x = x.detach().requires_grad_(True)
            wrt = [x]
            if stress:
                eps = torch.zeros(3, 3, dtype=x.dtype, device=x.device,
                                  requires_grad=True)  # fmt: skip
                wrt.append(eps)
                graph = with_cell(graph, strained(cell, eps))
                energy = self.model(strained(x, eps), numbers, graph)
            else:
                energy = self.model(x, numbers, graph)
            grads = torch.autograd.grad(energy, wrt, allow_unused=True)
        grads = [torch.zeros_like(t) if g is None else g for t, g in zip(wrt, grads)]
        virial = grads[1].detach() if stress else None
        return energy.detach(), -grads[0].detach(), virial
