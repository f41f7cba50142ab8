"""The model: an SO(3)-invariant potential with SO(2) convolutions in edge frames.

``ECEModel(config)(positions, numbers, graph) -> energy`` runs the stages of the
book's chapter 1 with the functions of :mod:`ecekern.reference`, or their fast
twins: the step plan (:mod:`ecekern.plan`) says which, once per device, dtype and
options. Each stage runs inside a ``torch.profiler.record_function("ece::<stage>")``
range, so a profile shows the time by stage. Forces are ``-dE/dx`` by autograd
(:func:`energy_and_forces`).
"""

from __future__ import annotations

import math
import weakref

import torch
from torch import nn
from torch.profiler import record_function

from . import (
    checkpoint,
    cohorts,
    edge_frame,
    edge_layer,
    options,
    reference,
    so3,
    zonal,
)
from .config import ECEConfig
from .edge_frame.launch import pack
from .graph import Graph, build_graph, check_graph, edge_vectors
from .linear import EquivariantLinear, equivariant_linear
from .plan import StepPlan, stack_precision
from .plan import plan_for as _plan_for
from .step import geometry as step_geometry
from .step import radial as step_radial

__all__ = ["ECEConfig", "ECEModel", "energy_and_forces", "force_step", "prepare_inputs"]
__all__ += ["unwrap"]


class _Interaction(nn.Module):
    def __init__(self, cfg: ECEConfig):
        super().__init__()
        F, n_ang, L, C = cfg.F, cfg.n_ang, cfg.lmax, cfg.channels
        self.gated = nn.ModuleList(
            EquivariantLinear(F, F, n_ang) for _ in range(cfg.n_gated)
        )
        self.out = EquivariantLinear(F, C * (L + 1), n_ang)
        self.node_weight = nn.Parameter(torch.randn(L + 1, C, C) / math.sqrt(C))


def _cohort_stack(layer: _Interaction, plan, x_cos, x_sin, x_rebuild=None):
    """The layer's mixing stack through :func:`ecekern.cohorts.mixing_stack`, as the
    plan says: its kernels (or the linears on the plan's path), precision, cohort
    size and memory strategy. The rows' m = 0 sin column is zero by construction
    (:func:`ecekern.reference.rotate_and_select`), so the kernels skip it
    (``sin0_zero``); the linears compute on it as it is (a zeroed copy would be one
    more activation kept). ``x_rebuild`` makes the rows again
    (:meth:`ECEModel._rebuild`): the stack then keeps none of them."""

    def linear(xc, xs, w, b):
        return equivariant_linear(xc, xs, w, b, plan.linear)

    kernels = plan.kernels
    return cohorts.mixing_stack(
        x_cos, x_sin, [lin.weight for lin in layer.gated],
        [lin.bias for lin in layer.gated], layer.out.weight, layer.out.bias,
        linear=linear, cohort_edges=plan.cohort_edges,
        recompute=plan.memory == "recompute", kernels=kernels,
        precision=stack_precision(plan.precision), sin0_zero=kernels is not None,
        x_rebuild=x_rebuild,
    )  # fmt: skip


def _plain_stack(layer: _Interaction, plan, x_cos, x_sin):
    """The layer's mixing stack with plain autograd, the linears on the plan's
    path."""
    u_cos, u_sin = x_cos, x_sin
    for lin in layer.gated:
        z_cos, z_sin = equivariant_linear(u_cos, u_sin, lin.weight, lin.bias,
                                          plan.linear)  # fmt: skip
        g_cos, g_sin = reference.gate(z_cos, z_sin)
        u_cos, u_sin = u_cos + g_cos, u_sin + g_sin
    out = layer.out
    return equivariant_linear(u_cos, u_sin, out.weight, out.bias, plan.linear)


def species_table(cfg: ECEConfig) -> torch.Tensor:
    """Atomic number + 1 -> embedding row, -1 for unknown elements; ``(max Z + 3,)``:
    ``table[z + 1]`` for ``z`` clamped to ``[-1, max Z + 1]``, so that every number
    out of range lands on a -1 at either end."""
    table = torch.full((max(cfg.species) + 3,), -1, dtype=torch.long)
    table[[z + 1 for z in cfg.species]] = torch.arange(len(cfg.species))
    return table


_FLOATS = (torch.float32, torch.float64)  # the dtypes the model computes in
_METHOD = {torch.float32: "float", torch.float64: "double"}


def _dtype_advice(x: torch.dtype, model: torch.dtype) -> str:
    """What to convert when positions in ``x`` meet a model in ``model``."""
    if model not in _FLOATS:
        return (f"the model is {model}; it computes in float32 or float64: convert "
                "it (model.float() or model.double())")  # fmt: skip
    fix = f"convert the positions (positions.to({model}))"
    if x in _FLOATS:
        fix += f" or the model (model.{_METHOD[x]}())"
    return (f"positions are {x} but the model is {model}; the model computes in "
            f"float32 or float64: {fix}")  # fmt: skip


def _silu_mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.SiLU()]
    return nn.Sequential(*layers[:-1])


class ECEModel(checkpoint.Persistent, nn.Module):
    """Energy of an atomic system (eV), invariant under rotations, translations,
    permutations of atoms and the gauge of each edge frame.

    ``forward(positions (N, 3), numbers (N,), graph) -> energy ()``.

    ``save(path)`` / ``ECEModel.load(path)`` write and read a checkpoint; the
    ``state_dict()`` holds the config, checked on load (``ecekern.checkpoint``).
    """

    def __init__(self, config: ECEConfig | None = None):
        super().__init__()
        cfg = config if config is not None else ECEConfig()
        if not isinstance(cfg, ECEConfig):
            raise TypeError(f"config must be an ECEConfig, got {type(cfg).__name__}")
        self.config = cfg
        L, C = cfg.lmax, cfg.channels
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            self.embedding = nn.Embedding(len(cfg.species), C)
            n_radial = L * C + cfg.n_interactions * cfg.F
            self.radial = _silu_mlp(
                [cfg.n_rbf, cfg.radial_hidden, cfg.radial_hidden, n_radial]
            )
            self.interactions = nn.ModuleList(
                _Interaction(cfg) for _ in range(cfg.n_interactions)
            )
            self.readout = _silu_mlp([C, cfg.readout_hidden, 1])
            self.species_energy = nn.Parameter(torch.zeros(len(cfg.species)))
        self.register_buffer("_species_index", species_table(cfg), persistent=False)

    # ----------------------------------------------------------------------------------
    def species_index(self, numbers: torch.Tensor) -> torch.Tensor:
        """Atomic numbers ``(N,)`` to embedding rows; unknown elements are an error."""
        if not isinstance(numbers, torch.Tensor):
            raise TypeError(
                f"numbers must be a torch.Tensor of atomic numbers, got "
                f"{type(numbers).__name__}"
            )
        if numbers.dtype not in (torch.int32, torch.int64):
            raise TypeError(
                f"numbers must be an integer tensor (torch.long), got {numbers.dtype}"
            )
        table = self._species_index
        idx = table[numbers.long().clamp(-1, table.shape[0] - 2) + 1]  # -1: unknown
        if self._checked_numbers(numbers):
            return idx
        if not bool((idx >= 0).all()):  # the one host sync of the check
            bad = sorted(set(numbers[idx < 0].tolist()))
            hint = (
                "atomic numbers run from 1 to 118"
                if any(not 1 <= z <= 118 for z in bad)
                else "a model for them needs ECEConfig(species=...) including them"
            )
            raise ValueError(
                f"atomic numbers {bad} are not among the model's species "
                f"{self.config.species}; {hint}"
            )
        self._remember_numbers(numbers)
        return idx

    # The check reads the data back to the host: a synchronisation. It runs once per
    # numbers tensor: an MD run or a benchmark hands the model the same tensor every
    # step, and any in-place change bumps the tensor's version, which is remembered.
    def _numbers_key(self, numbers: torch.Tensor):
        if torch.compiler.is_compiling() or numbers.is_inference():
            return None  # no version counter to trust
        return (numbers._version, numbers.device, self._species_index.data_ptr())

    def _checked_numbers(self, numbers: torch.Tensor) -> bool:
        seen = self.__dict__.get("_numbers_seen")
        key = self._numbers_key(numbers)
        return (
            seen is not None
            and key is not None
            and seen[0]() is numbers
            and (seen[1] == key)
        )

    def _remember_numbers(self, numbers: torch.Tensor) -> None:
        key = self._numbers_key(numbers)
        if key is not None:
            self.__dict__["_numbers_seen"] = (weakref.ref(numbers), key)

    def __getstate__(self):  # pickling (torch.save): the memo is not state
        state = self.__dict__.copy()
        state.pop("_numbers_seen", None)
        return state

    def _check(
        self, positions: torch.Tensor, numbers: torch.Tensor, graph: Graph
    ) -> None:
        p = next(self.parameters())
        if (
            not isinstance(positions, torch.Tensor)
            or positions.ndim != 2
            or positions.shape[1] != 3
        ):
            raise ValueError("positions must be a (N, 3) tensor")
        if positions.dtype != p.dtype or p.dtype not in _FLOATS:
            raise TypeError(_dtype_advice(positions.dtype, p.dtype))
        if positions.device != p.device:
            raise ValueError(
                f"positions are on {positions.device}, the model on {p.device}"
            )
        if not isinstance(numbers, torch.Tensor):
            raise TypeError(
                f"numbers must be a torch.Tensor of atomic numbers, got "
                f"{type(numbers).__name__}"
            )
        if numbers.shape != positions.shape[:1]:
            raise ValueError(
                f"numbers must have shape ({positions.shape[0]},), "
                f"got {tuple(numbers.shape)}"
            )
        if numbers.device != positions.device:
            raise ValueError(
                f"numbers are on {numbers.device}, positions on {positions.device}"
            )
        if not isinstance(graph, Graph):
            raise TypeError(
                f"graph must be an ecekern.Graph (from build_graph), got "
                f"{type(graph).__name__}"
            )
        if graph.n_nodes != positions.shape[0]:
            raise ValueError(
                f"graph has {graph.n_nodes} nodes, positions {positions.shape[0]}"
            )
        graph.check_cutoff(self.config.cutoff)
        for name in ("src", "dst", "shifts", "row_ptr", "cell", "system"):
            t = getattr(graph, name)
            if t is not None and t.device != positions.device:
                raise ValueError(
                    f"graph.{name} is on {t.device}, positions on {positions.device}"
                )

    def plan(self, device=None, dtype=None) -> StepPlan:
        """The :class:`~ecekern.plan.StepPlan` a force step takes on ``device`` in
        ``dtype`` (default: the parameters'), with the options in force now."""
        return _plan_for(self, device, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        numbers: torch.Tensor,
        graph: Graph,
        gauge: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Total energy. ``gauge (E,)``: an optional extra rotation of each edge
        frame about its axis (the energy must not change; tests use it)."""
        return self.atom_energies(positions, numbers, graph, gauge).sum()

    @staticmethod
    def _rebuild(frames, h, rho_t, graph: Graph, D, M: int, planes: bool):
        """How to make the stack's input again in the backward (the rotation that
        made it, from h and rho, which the rotation's own backward keeps anyway),
        or None: keep it. The stack keeps no input then: a force step's backward
        from the kept z never reads it, the others run the rotation once more
        (no reductions across programs: the same rows bit for bit)."""
        if not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return None
        if frames is not None:
            return lambda: frames.rotate_and_select(h, rho_t, planes)

        def rows():
            x_cos, x_sin = reference.rotate_and_select(h, graph.src, graph.dst, D, M)
            return x_cos * rho_t[:, :, None], x_sin * rho_t[:, :, None]

        return rows

    @staticmethod
    def _edge_layer(layer, plan, frames, D, M, h, rho_t, env, graph, k):
        """Delta of one interaction layer by chapter 8's fused kernels, from the
        packed frame tiles (the frames', or packed from D here)."""
        packed = frames is not None and frames.packed
        P = frames.d if packed else pack(D, M)
        order = frames.csr[2:] if frames is not None else None
        return edge_layer.edge_layer(
            h, P, rho_t, env, graph.src, graph.dst, graph.row_ptr,
            [lin.weight for lin in layer.gated], [lin.bias for lin in layer.gated],
            layer.out.weight, layer.out.bias, k, stack_precision(plan.precision),
            order,
        )  # fmt: skip

    def atom_energies(
        self, positions, numbers, graph: Graph, gauge=None
    ) -> torch.Tensor:
        """Per-atom energies ``(N,)``, by the stages of :meth:`plan`."""
        self._check(positions, numbers, graph)
        check_graph(graph)  # a graph made by hand, once; build_graph's are checked
        plan = self.plan(positions.device, positions.dtype)
        plan.announce()
        cfg = self.config
        L, M, C, k = cfg.lmax, cfg.M, cfg.channels, cfg.scale
        N = positions.shape[0]
        species = self.species_index(numbers)
        # padding edges (chapter 4) sit at twice the cutoff: exactly zero there
        pad = 2.0 * cfg.cutoff
        fused_geometry = plan.geometry == "fused"
        if fused_geometry and gauge is not None:
            options.fallback("geometry [fused]", "a gauge rotation of the frames "
                             "(tests)", "the reference composition")  # fmt: skip
            fused_geometry = False
        if fused_geometry and graph.system is not None:
            options.fallback("geometry [fused]", "a batch of systems (one cell each)",
                             "the reference composition")  # fmt: skip
            fused_geometry = False
        D = None
        if fused_geometry:  # chapter 7: D never formed, its packed tiles written
            with record_function("ece::geometry"):
                order = step_geometry.src_order(graph)
                P, Z, d, env = step_geometry.geometry(positions, graph, L, M, pad,
                                                      order)  # fmt: skip
                frames = edge_frame.Frames.from_packed(
                    P, M, graph.src, graph.dst, N, graph.row_ptr, order
                )
        else:
            with record_function("ece::geometry"):
                r = edge_vectors(positions, graph, pad_length=pad)
                d = torch.linalg.vector_norm(r, dim=-1)
                env = reference.envelope(d, cfg.cutoff)  # (E,), u(d_e)
            with record_function("ece::edge_frames"):
                D = so3.edge_frames(L, r, gauge)  # (E, S, S)
                Z = reference.zonal_rows(D)
                # chapter 3: D packed once for every edge-frame op of the step (or
                # None: the reference's stages)
                frames = None
                if plan.edge_frame != "reference":
                    frames = edge_frame.frames_for(
                        D, M, graph.src, graph.dst, N, graph.row_ptr, plan.edge_frame
                    )
        with record_function("ece::radial"):
            if plan.radial == "fused":  # chapter 7
                weights = [(lin.weight, lin.bias) for lin in self.radial[::2]]
                radial = step_radial.radial(d, weights, cfg.cutoff, cfg.n_rbf,
                                            plan.radial_precision)  # fmt: skip
            else:
                rbf = reference.radial_basis(d, cfg.n_rbf, cfg.cutoff)
                radial = self.radial(rbf) * env[:, None]
            R0, rho = radial.split([L * C, cfg.n_interactions * cfg.F], dim=-1)
        with record_function("ece::gie"):
            args = (Z, R0.reshape(-1, L, C), graph.dst, graph.row_ptr, k)
            # the graph's CSR is checked (check_graph): no host syncs here
            if plan.zonal == "fused":
                h_rest = zonal.zonal_scatter(*args, validate=False)
            else:
                h_rest = reference.zonal_scatter(*args, validate=False)
            # a number changed behind the checked tensor's back (through numpy
            # memory, say) is -1: its atom's energy is NaN, never another element's
            rows = species.clamp(min=0)
            h0 = self.embedding(rows)[:, None, :]
            h = torch.cat([h0, h_rest[:, 1:]], dim=1)  # (N, S, C)
        # chapter 6's layer kernels read the rows as planes: the rotation writes
        # them so (and the stack's output and gradients stay so), with no copies
        planes = plan.planes
        for layer, rho_t in zip(
            self.interactions, rho.chunk(max(cfg.n_interactions, 1), -1)
        ):
            if plan.edge_layer == "triton":  # chapter 8: the four stages, one kernel
                with record_function("ece::edge_layer"):
                    delta = self._edge_layer(layer, plan, frames, D, M, h, rho_t,
                                             env, graph, k)  # fmt: skip
                with record_function("ece::node_update"):
                    h = reference.node_update(h, delta, layer.node_weight)
                continue
            if frames is not None:  # the modulation is folded into the store
                with record_function("ece::rotate_and_select"):
                    x_cos, x_sin = frames.rotate_and_select(h, rho_t, planes)
            else:
                with record_function("ece::rotate_and_select"):
                    x_cos, x_sin = reference.rotate_and_select(
                        h, graph.src, graph.dst, D, M
                    )
                with record_function("ece::radial_modulation"):
                    x_cos = x_cos * rho_t[:, :, None]
                    x_sin = x_sin * rho_t[:, :, None]
            with record_function("ece::mixing_stack"):
                if plan.cohorts:  # chapter 6
                    rebuild = self._rebuild(frames, h, rho_t, graph, D, M, planes)
                    y_cos, y_sin = _cohort_stack(layer, plan, x_cos, x_sin, rebuild)
                    del rebuild
                else:
                    y_cos, y_sin = _plain_stack(layer, plan, x_cos, x_sin)
            if frames is not None:  # the message never leaves the registers
                with record_function("ece::pack_and_unrotate"):
                    delta = frames.unrotate_and_aggregate(y_cos, y_sin, k, env)
            else:
                with record_function("ece::pack_and_unrotate"):
                    msg = reference.pack_and_unrotate(y_cos, y_sin, D, M)
                with record_function("ece::aggregate"):
                    delta = reference.aggregate(msg, graph.dst, N, k, env)
            with record_function("ece::node_update"):
                h = reference.node_update(h, delta, layer.node_weight)
        with record_function("ece::readout"):
            e = self.readout(h[:, 0, :]).squeeze(-1) + self.species_energy[rows]
            e = torch.where(species >= 0, e, math.nan)
        return e


def unwrap(model) -> ECEModel:
    """The :class:`ECEModel` of ``model``: itself, or the module that
    ``torch.compile(model)`` wraps (``._orig_mod``); anything else is a TypeError."""
    inner = getattr(model, "_orig_mod", None)
    if isinstance(model, torch.nn.Module) and isinstance(inner, ECEModel):
        return inner
    if not isinstance(model, ECEModel):
        raise TypeError(
            f"model must be an ECEModel or torch.compile(ECEModel), got "
            f"{type(model).__name__}"
        )
    return model


def prepare_inputs(atoms, cutoff: float, dtype=torch.float64, device="cpu"):
    """``(positions (N, 3), numbers (N,), graph)`` of an ``ase.Atoms`` on ``device``.

    The graph is :func:`~ecekern.graph.build_graph`'s, with its checks (overlapping
    atoms, degenerate cells, searches too large: a ValueError naming the fix).
    """
    from ase import Atoms

    if not isinstance(atoms, Atoms):
        raise TypeError(f"atoms must be an ase.Atoms, got {type(atoms).__name__}")
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    device = torch.device(device)
    positions = torch.tensor(atoms.get_positions(), dtype=dtype, device=device)
    cell = torch.tensor(atoms.cell.array, dtype=dtype, device=device)
    numbers = torch.tensor(atoms.get_atomic_numbers(), dtype=torch.long, device=device)
    graph = build_graph(positions, cell, atoms.pbc, cutoff)
    return positions, numbers, graph


def force_step(model, positions, numbers, graph, create_graph: bool = False):
    """One force evaluation on a prepared graph: ``(energy, forces = -dE/dx)``.

    ``model`` is any module with ``model(positions, numbers, graph) -> energy`` (the
    peers of chapter 1 too). ``positions`` is not modified.
    """
    # forces need autograd, also when the caller is under no_grad or inference_mode
    with torch.inference_mode(False), torch.enable_grad():
        x = positions.detach()
        if x.is_inference():  # an inference tensor cannot require grad: a copy
            x = x.clone()
        x = x.requires_grad_(True)
        energy = model(x, numbers, graph)
        if x.shape[0] == 0:
            return energy, torch.zeros_like(x)
        (grad,) = torch.autograd.grad(energy, x, create_graph=create_graph)
    return (energy if create_graph else energy.detach()), -grad


def energy_and_forces(
    model: ECEModel,
    atoms,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    create_graph: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Energy (eV, a 0-d tensor) and forces ``-dE/dx`` (eV/A, ``(N, 3)``) of ``atoms``.

    The step runs in the model's dtype and on its device; the model is never converted
    or moved here. Put it where you want it first: ``model.double()`` for float64
    (``ECEModel`` is built in the default dtype, float32), ``model.to("cuda")``.

    Args:
        model: an :class:`ECEModel` in float32 or float64, or ``torch.compile`` of
            one (the compiled module computes; the ECEModel gives config and checks).
        atoms: an ``ase.Atoms`` (positions in A, cell, pbc, atomic numbers).
        dtype: None (the model's dtype), or the model's dtype spelt out; any other is
            a TypeError naming the fix, ``model.to(dtype)``.
        device: None (the model's device), or the model's device spelt out; any other
            is a ValueError naming the fix, ``model.to(device)``.
        create_graph: keep the graph of the forces (for a force-loss training step).
    """
    module = unwrap(model)
    p = next(module.parameters())
    if p.dtype not in (torch.float32, torch.float64):
        raise TypeError(
            f"the model is {p.dtype}; energy_and_forces computes in float32 or "
            "float64: call model.float() or model.double() first"
        )
    if dtype is not None:
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(
                f"dtype must be None (the model's), torch.float32 or torch.float64, "
                f"got {dtype!r}"
            )
        if dtype != p.dtype:
            raise TypeError(
                f"dtype={dtype} but the model is {p.dtype}, and energy_and_forces "
                f"does not convert it: call model.to({dtype}) first, or leave dtype out"
            )
    if device is not None:
        want = torch.device(device)
        same = want.type == p.device.type and (
            want.type == "cpu" or want.index in (None, p.device.index)
        )  # "cpu:0" is the CPU; "cuda" is the current GPU
        if not same:
            raise ValueError(
                f"device={str(want)!r} but the model is on {p.device}, and "
                f"energy_and_forces does not move it: call model.to({str(want)!r}) "
                "first, or leave device out"
            )
    with torch.inference_mode(False):  # the graph is saved for the backward
        positions, numbers, graph = prepare_inputs(
            atoms, module.config.cutoff, p.dtype, p.device
        )
    return force_step(model, positions, numbers, graph, create_graph)
