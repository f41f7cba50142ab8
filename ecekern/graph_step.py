"""The force step as one CUDA graph, with an edge capacity for molecular dynamics.

A step of energy and forces, ``E = model(x, numbers, graph)``, ``F = -dE/dx`` (and,
with ``stress=True``, the virial ``W = dE/d eps`` of a symmetric strain, as in
:mod:`ecekern.calculator`), launches a few hundred kernels. Run eagerly, the host
must queue every one of them; at 512 atoms it takes longer to queue them than the GPU
takes to run them. A CUDA graph records the launches once and replays them with one
call. That needs a step with no host synchronisation and no host-to-device copy
(:mod:`ecekern.host_sync` finds them) and fixed tensor shapes and addresses.

Shapes. The atoms are fixed: ``x (N, 3)``, ``numbers (N,)``. The edges are not: an MD
step's neighbour list has ``E`` edges, a few more or fewer each step. The step stores
them in buffers of a fixed *capacity* ``E_cap >= E``, with ``E_cap - E`` *padding
edges* spread over the atoms, ``p_n = (E_cap - E) // N`` or one more to each::

    offset[n] = p_0 + ... + p_(n-1)                 (exclusive prefix sum, N+1)
    row_ptr'  = row_ptr + offset                    (each segment p_n longer)
    edge e of the graph goes to slot e + offset[dst_e]
    the last p_n slots of atom n's segment: src = dst = n, shift = 0   (padding)

A padding edge is an atom's self-edge with no shift, a vector of length zero, which the
model moves beyond the cutoff (``Graph.padded``): it adds exactly zero to the energy,
the forces and the virial. The edges stay sorted by destination, and every atom's
program in the CSR kernels of chapters 3 and 5 gets at most one padding edge more than
another's (padding all on one atom would make that atom's program walk them all
alone). When a step brings more than ``E_cap`` edges, the capacity grows to
``headroom * E`` and the graph is captured again; the ``ecekern.graph_step`` logger
says so.

A capture bakes in the kernels the options chose (and TF32) and the parameters'
addresses: in-place updates of the parameters are seen by the next replay; moved
parameters or changed options mean a new capture, which the log says.

Per step, outside the graph: copies of the positions, the edge lists and the CSR
pointer into the buffers (device to device, ``O(N + E)`` bytes), then one replay.
Outputs are copied out of the graph's static tensors, so a caller may keep them.

Status: CUDA graphs on CUDA devices, float32 and float64; on other devices, and with
``graphs=False``, the same padded step runs eagerly (the CPU tests use it).
"""

from __future__ import annotations

import logging
import math
import numbers as _numbers
from dataclasses import dataclass

import torch

from . import options
from .graph import Graph, check_graph, with_cell
from .model import ECEModel, unwrap
from .plan import plan_for

__all__ = ["GraphStep", "StepResult", "strained"]

log = logging.getLogger(__name__)

#: capacities are rounded up to a multiple of this many edges
CAPACITY_QUANTUM = 32


def strained(x: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """``x (I + eps)`` for row vectors ``x (..., 3)``, written as ``x + sum_i x_i
    eps_ij`` with elementwise products: at ``eps = 0`` the value is ``x`` bit for bit,
    and no matmul can round ``x`` to TF32 when a user allows it for float32."""
    return x + (x[..., :, None] * eps).sum(-2)


def eager_step(model, positions, numbers, graph: Graph, stress: bool):
    """The force step without a CUDA graph: ``(energy, [dE/dx, dE/d eps])`` at zero
    strain (``dE/d eps``, the virial in eV, only with ``stress``: the positions and
    the cell strained by ``I + eps``, the shifts integer and fixed, so
    ``r_e' = r_e (I + eps)`` exactly). A gradient that nothing reaches (no edge and
    no parameter needing one) is zero."""
    with torch.inference_mode(False), torch.enable_grad():
        x = positions.detach().requires_grad_(True)
        wrt = [x]
        if stress:
            eps = torch.zeros(3, 3, dtype=x.dtype, device=x.device, requires_grad=True)
            wrt.append(eps)
            graph = with_cell(graph, strained(graph.cell, eps))
            x = strained(x, eps)
        energy = model(x, numbers, graph)
        if energy.requires_grad:
            grads = torch.autograd.grad(energy, wrt, allow_unused=True)
        else:  # E does not depend on x
            grads = (None,) * len(wrt)
    grads = [torch.zeros_like(t) if g is None else g for t, g in zip(wrt, grads)]
    return energy.detach(), grads


@dataclass(frozen=True)
class StepResult:
    """One step's outputs: ``energy ()``, ``forces (N, 3) = -dE/dx`` and, when the
    step was built with ``stress=True``, ``virial (3, 3) = dE/d eps`` (eV)."""

    energy: torch.Tensor
    forces: torch.Tensor
    virial: torch.Tensor | None = None


class GraphStep:
    """Energy and forces of one system, replayed as a CUDA graph.

    Args:
        model: an :class:`~ecekern.ECEModel`, on the device and in the dtype the step
            runs in, or ``torch.compile`` of one (which then computes the energy).
        numbers: ``(N,)`` atomic numbers; checked once, here.
        capacity: the edges the first capture holds (None: the first graph's edge
            count times ``headroom``).
        headroom: the capacity of a (re)capture is ``ceil(headroom * E)``, rounded up
            to a multiple of :data:`CAPACITY_QUANTUM`. Every padding edge costs what
            an edge costs (the per-edge GEMMs and kernels run over ``E_cap`` rows),
            so the replay's GPU time grows by about ``E_cap / E``; a larger headroom
            buys fewer recaptures when the neighbour count drifts.
        stress: also return the virial ``dE/d eps`` of a strain of positions and cell.
        graphs: replay a CUDA graph (None: on CUDA devices). ``True`` on a device
            without CUDA graphs falls back to the eager step with a
            :class:`~ecekern.options.FallbackWarning`.

    ``step(positions, graph)`` returns a :class:`StepResult`. ``captures`` counts the
    CUDA graphs captured so far (0 when eager); ``capacity`` is the edge capacity;
    ``cutoff`` is the model's, which every graph must have been built with.
    """

    def __init__(
        self,
        model: ECEModel,
        numbers: torch.Tensor,
        capacity: int | None = None,
        headroom: float = 1.05,
        stress: bool = False,
        graphs: bool | None = None,
    ):
        module: ECEModel = unwrap(model)  # config, parameters and checks
        p = next(module.parameters())
        if not isinstance(numbers, torch.Tensor) or numbers.ndim != 1:
            raise ValueError("numbers must be a (N,) tensor of atomic numbers")
        if numbers.device != p.device:
            raise ValueError(
                f"numbers are on {numbers.device}, the model on {p.device}"
            )
        if numbers.shape[0] == 0:
            raise ValueError("a GraphStep needs at least one atom")
        if not (isinstance(headroom, (int, float)) and 1.0 <= headroom <= 16.0):
            raise ValueError(f"headroom must be a number in [1, 16], got {headroom!r}")
        if capacity is not None and (
            isinstance(capacity, bool)
            or not isinstance(capacity, _numbers.Integral)
            or capacity < 0
        ):
            raise ValueError(f"capacity must be a non-negative int, got {capacity!r}")
        with torch.inference_mode(False):  # a tensor with a version counter
            numbers = numbers.clone()
        module.species_index(numbers)  # the check, once (a host sync)
        self.model, self.numbers, self.cutoff = model, numbers, module.config.cutoff
        self.N, self.dtype, self.device = numbers.shape[0], p.dtype, p.device
        self.headroom, self.stress = float(headroom), bool(stress)
        cuda = self.device.type == "cuda"
        if graphs is None:
            graphs = cuda
        elif graphs and not cuda:
            options.fallback(
                "GraphStep",
                f"CUDA graphs need a CUDA device, the model is on {self.device}",
                to="the same padded step run eagerly",
            )
            graphs = False
        self.graphs = bool(graphs)
        # -1: chosen at the first step, from its edge count
        self.capacity = -1 if capacity is None else _round_up(int(capacity))
        self.captures = 0
        self._graph = None
        self._out: tuple | None = None
        self._x: torch.Tensor | None = None  # buffers, allocated at the first step

    # -- buffers ---------------------------------------------------------------------
    def _allocate(self, capacity: int) -> None:
        with torch.inference_mode(False):  # buffers that autograd may see
            self._allocate_buffers(capacity)

    def _allocate_buffers(self, capacity: int) -> None:
        N, dev = self.N, self.device
        long = dict(dtype=torch.long, device=dev)
        self.capacity = capacity
        self._x = torch.zeros(N, 3, dtype=self.dtype, device=dev)
        self._cell = torch.zeros(3, 3, dtype=self.dtype, device=dev)
        self._src = torch.zeros(capacity, **long)
        self._dst = torch.zeros(capacity, **long)
        self._shifts = torch.zeros(capacity, 3, **long)
        self._row_ptr = torch.zeros(N + 1, **long)
        self._offset = torch.zeros(N + 1, **long)
        self._atoms = torch.arange(N, **long)
        self._slots = torch.arange(capacity, **long)

    def _load(self, positions: torch.Tensor, graph: Graph) -> None:
        """The step's inputs into the buffers, the padding spread over the atoms
        (module docstring). Device ops only, sized by E and the capacity: no sync."""
        E, N, pad = graph.n_edges, self.N, self.capacity - graph.n_edges
        self._x.copy_(positions)
        self._cell.copy_(graph.cell)
        n_pad = (self._atoms < pad % N).long() + pad // N  # (N,), sums to pad
        torch.cumsum(n_pad, 0, out=self._offset[1:])
        torch.add(graph.row_ptr, self._offset, out=self._row_ptr)
        # every slot a padding self-edge of its segment's atom, then the real edges
        seg = torch.searchsorted(self._row_ptr[1:], self._slots, right=True)
        self._src.copy_(seg)
        self._dst.copy_(seg)
        self._shifts.zero_()
        slot = self._slots[:E] + self._offset[graph.dst]
        self._src[slot] = graph.src
        self._dst[slot] = graph.dst
        self._shifts[slot] = graph.shifts

    def _run(self) -> tuple:
        """The step on the buffers; what a capture records."""
        with torch.inference_mode(False), torch.enable_grad():
            x = self._x.detach().requires_grad_(True)
            wrt = [x]
            cell = self._cell
            if self.stress:
                eps = torch.zeros(3, 3, dtype=self.dtype, device=self.device)
                eps.requires_grad_(True)
                wrt.append(eps)
                x, cell = strained(x, eps), strained(cell, eps)
            g = Graph(self._src, self._dst, self._shifts, self._row_ptr, cell, True,
                      cutoff=self.cutoff)  # fmt: skip
            object.__setattr__(g, "checked", True)  # _load keeps it a valid CSR
            energy = self.model(x, self.numbers, g)
            grads = torch.autograd.grad(energy, wrt)
        return (energy.detach(), -grads[0]) + tuple(grads[1:])

    # -- capture ---------------------------------------------------------------------
    def _new_capacity(self, n_edges: int) -> int:
        if self.capacity >= n_edges:  # the first call, with a capacity given
            return self.capacity
        return _round_up(max(math.ceil(self.headroom * n_edges), n_edges))

    def _capture(self) -> None:
        """Record :meth:`_run` on the loaded buffers, after two eager runs on a side
        stream (Triton compiles, caches fill and the allocator warms up outside)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._run()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self._graph = self._out = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=torch.cuda.Stream(self.device)):
            self._out = self._run()
        # the graph reads the parameters where they are now: in-place updates are
        # seen by the next replay; moved parameters or other options: a new capture
        self._graph, self._baked = graph, self._state()
        self.captures += 1

    # -- the step --------------------------------------------------------------------
    def _check(self, positions, graph) -> None:
        if not isinstance(graph, Graph):
            raise TypeError(
                f"graph must be an ecekern.Graph, got {type(graph).__name__}"
            )
        if graph.padded:
            raise ValueError("give the step the neighbour list, not a padded graph")
        if graph.system is not None:
            raise ValueError("a GraphStep replays one system; a batch of systems "
                             "(graph.system) runs eagerly (ecekern.train)")  # fmt: skip
        if not isinstance(positions, torch.Tensor) or positions.shape != (self.N, 3):
            raise ValueError(f"positions must be a ({self.N}, 3) tensor")
        if positions.dtype != self.dtype:
            raise TypeError(f"positions are {positions.dtype}, the step {self.dtype}")
        if graph.n_nodes != self.N:
            raise ValueError(f"graph has {graph.n_nodes} nodes, the step {self.N}")
        graph.check_cutoff(self.cutoff)
        for name in ("src", "dst", "shifts", "row_ptr", "cell"):
            t = getattr(graph, name)
            if t.device != self.device:
                raise ValueError(f"graph.{name} is on {t.device}, the step on "
                                 f"{self.device}")  # fmt: skip
        if positions.device != self.device:
            raise ValueError(f"positions are on {positions.device}, the step on "
                             f"{self.device}")  # fmt: skip

    def __call__(self, positions: torch.Tensor, graph: Graph) -> StepResult:
        """Energy, forces (and virial) for ``positions (N, 3)`` and the neighbour list
        ``graph`` (from :func:`~ecekern.graph.build_graph`, on the step's device)."""
        self._check(positions, graph)
        check_graph(graph)  # a graph made by hand, once (build_graph's are checked)
        p = next(self.model.parameters())
        if (p.dtype, p.device) != (self.dtype, self.device):
            raise ValueError(
                f"the model is now {p.dtype} on {p.device}, this step was built for "
                f"{self.dtype} on {self.device}: build a new GraphStep"
            )
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                return self._step(positions, graph)
        return self._step(positions, graph)

    def _step(self, positions: torch.Tensor, graph: Graph) -> StepResult:
        E = graph.n_edges
        grow = self._x is None or E > self.capacity
        if grow:
            old, capacity = self.capacity, self._new_capacity(E)
            self._graph, self._out = None, None  # the old graph's memory goes first
            self._allocate(capacity)
            if self.graphs and self.captures:
                log.warning(
                    "GraphStep: %d edges exceed the capacity %d; capturing the step "
                    "again for %d edges", E, old, capacity,
                )  # fmt: skip
            elif self.graphs:
                log.info("GraphStep: capturing the step for %d edges", capacity)
        self._load(positions.detach(), graph)
        if not self.graphs:
            return StepResult(*self._run())
        if self._graph is None:
            self._capture()
        if self._baked != self._state():
            log.warning(
                "GraphStep: the model's parameters moved or the step plan changed "
                "(options, TF32) since the capture; capturing again"
            )
            self._capture()
        self._graph.replay()
        return StepResult(*(t.clone() for t in self._out))

    def _state(self) -> tuple:
        """What a capture bakes in besides the buffers: where the parameters are,
        and the step plan that chose the kernels (options and TF32 switch)."""
        params = tuple(p.data_ptr() for p in self.model.parameters())
        return params, plan_for(self.model, self.device, self.dtype)

    @property
    def plan(self):
        """The :class:`~ecekern.plan.StepPlan` of the captured step (None before
        the first capture, or when eager)."""
        return None if self._graph is None else self._baked[1]


def _round_up(n: int) -> int:
    return max(CAPACITY_QUANTUM, -(-n // CAPACITY_QUANTUM) * CAPACITY_QUANTUM)
