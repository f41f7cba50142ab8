"""The model: an SO(3)-invariant potential with SO(2) convolutions in edge frames.

``ECEModel(config)(positions, numbers, graph) -> energy`` runs the stages of the
book's chapter 1 with the functions of :mod:`ecekern.reference` (or, when the options
switch them on, their fast twins). Each stage runs inside a
``torch.profiler.record_function("ece::<stage>")`` range, so a profile shows the time
by stage. Forces are ``-dE/dx`` by autograd (:func:`energy_and_forces`).
"""

from __future__ import annotations

import math
import numbers as _numbers
import weakref
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.profiler import record_function

from . import cohorts, edge_frame, options, reference, so3, zonal
from .graph import MIN_DISTANCE, Graph, build_graph, check_graph, edge_vectors
from .linear import EquivariantLinear, equivariant_linear

__all__ = ["ECEConfig", "ECEModel", "energy_and_forces", "force_step", "prepare_inputs"]

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
            :data:`~ecekern.model.MAX_CUTOFF`.
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


class _Interaction(nn.Module):
    def __init__(self, cfg: ECEConfig):
        super().__init__()
        F, n_ang, L, C = cfg.F, cfg.n_ang, cfg.lmax, cfg.channels
        self.gated = nn.ModuleList(
            EquivariantLinear(F, F, n_ang) for _ in range(cfg.n_gated)
        )
        self.out = EquivariantLinear(F, C * (L + 1), n_ang)
        self.node_weight = nn.Parameter(torch.randn(L + 1, C, C) / math.sqrt(C))


#: The ``cohort_fused`` option's products -> :func:`ecekern.cohorts.mixing_stack`'s
#: precision names.
_OPTION_PRECISIONS = {
    "ieee": "fp32",
    "tf32x3": "3xtf32",
    "tf32": "tf32",
    "bf16": "bf16",
}


def _stack_kernels(option: str | None) -> tuple[str | None, str]:
    """``(kernels, precision)`` for :func:`ecekern.cohorts.mixing_stack` from
    :func:`ecekern.options.cohort_precision`'s answer: None -> the linears; a
    product precision (``"ieee"``, ``"tf32x3"``, ``"tf32"``, ``"bf16"``) -> the
    layer kernels; that name with the fused stack's suffix -> the fused stack."""
    if option is None:
        return None, "fp32"
    products, suffix, rest = option.partition("-")
    if products not in _OPTION_PRECISIONS or rest not in ("", "stack"):
        raise ValueError(f"cohort_fused {option!r} names no stack kernels")
    return ("fused" if suffix else "layers"), _OPTION_PRECISIONS[products]


def _cohort_stack(layer: _Interaction, x_cos, x_sin, x_rebuild=None):
    """The layer's mixing stack through :func:`ecekern.cohorts.mixing_stack`, with
    the layer's own EquivariantLinear path and the ``cohort_edges``,
    ``cohort_recompute`` and ``cohort_fused`` options. The rows' m = 0 sin column
    is zero by construction (:func:`ecekern.reference.rotate_and_select`), so the
    stack kernels skip it (``sin0_zero``); the linears compute on it as it is (a
    zeroed copy would be one more activation kept), also where the kernels were
    asked for and fall back (then ``mixing_stack`` zeroes a copy itself).
    ``x_rebuild`` makes the rows again (:meth:`ECEModel._rebuild`): the stack then
    keeps none of them."""
    path, now = layer.out.path, options.current()
    option = options.cohort_precision(x_cos.device.type, x_cos.dtype)
    kernels, precision = _stack_kernels(option)

    def linear(xc, xs, w, b):
        return equivariant_linear(xc, xs, w, b, path)

    return cohorts.mixing_stack(
        x_cos, x_sin, [lin.weight for lin in layer.gated],
        [lin.bias for lin in layer.gated], layer.out.weight, layer.out.bias, linear,
        now.cohort_edges, now.cohort_recompute, kernels, precision,
        sin0_zero=kernels is not None, x_rebuild=x_rebuild,
    )  # fmt: skip


def species_table(cfg: ECEConfig) -> torch.Tensor:
    """Atomic number + 1 -> embedding row, -1 for unknown elements; ``(max Z + 3,)``:
    ``table[z + 1]`` for ``z`` clamped to ``[-1, max Z + 1]``, so that every number
    out of range lands on a -1 at either end."""
    table = torch.full((max(cfg.species) + 3,), -1, dtype=torch.long)
    table[[z + 1 for z in cfg.species]] = torch.arange(len(cfg.species))
    return table


def _silu_mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.SiLU()]
    return nn.Sequential(*layers[:-1])


class ECEModel(nn.Module):
    """Energy of an atomic system (eV), invariant under rotations, translations,
    permutations of atoms and the gauge of each edge frame.

    ``forward(positions (N, 3), numbers (N,), graph) -> energy ()``.
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
        if positions.dtype != p.dtype:
            raise TypeError(
                f"positions are {positions.dtype} but the model is {p.dtype}; "
                f"use model.to({positions.dtype})"
            )
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
        for name in ("src", "dst", "shifts", "row_ptr", "cell"):
            t = getattr(graph, name)
            if t.device != positions.device:
                raise ValueError(
                    f"graph.{name} is on {t.device}, positions on {positions.device}"
                )

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

    def atom_energies(
        self, positions, numbers, graph: Graph, gauge=None
    ) -> torch.Tensor:
        """Per-atom energies ``(N,)``."""
        self._check(positions, numbers, graph)
        check_graph(graph)  # a graph made by hand, once; build_graph's are checked
        cfg = self.config
        L, M, C, k = cfg.lmax, cfg.M, cfg.channels, cfg.scale
        N = positions.shape[0]
        species = self.species_index(numbers)
        with record_function("ece::geometry"):
            # padding edges (chapter 4) sit at twice the cutoff: exactly zero there
            r = edge_vectors(positions, graph, pad_length=2.0 * cfg.cutoff)
            d = torch.linalg.vector_norm(r, dim=-1)
            rbf = reference.radial_basis(d, cfg.n_rbf, cfg.cutoff)
            env = reference.envelope(d, cfg.cutoff)  # (E,), u(d_e)
            radial = self.radial(rbf) * env[:, None]
            R0, rho = radial.split([L * C, cfg.n_interactions * cfg.F], dim=-1)
        with record_function("ece::edge_frames"):
            D = so3.edge_frames(L, r, gauge)  # (E, S, S)
            # chapter 3: D packed once for every edge-frame op of the step (or None:
            # the reference's stages)
            frames = edge_frame.frames_for(D, M, graph.src, graph.dst, N, graph.row_ptr)
        with record_function("ece::gie"):
            Z = reference.zonal_rows(D)
            args = (Z, R0.reshape(-1, L, C), graph.dst, graph.row_ptr, k)
            # the graph's CSR is checked (check_graph): no host syncs here
            if options.zonal_fused(Z.device.type):
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
        planes = options.cohorts_on(positions.device.type) and (
            options.cohort_precision(positions.device.type, positions.dtype) is not None
        )
        for layer, rho_t in zip(
            self.interactions, rho.chunk(max(cfg.n_interactions, 1), -1)
        ):
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
                if options.cohorts_on(x_cos.device.type):  # chapter 6
                    rebuild = self._rebuild(frames, h, rho_t, graph, D, M, planes)
                    y_cos, y_sin = _cohort_stack(layer, x_cos, x_sin, rebuild)
                    del rebuild
                else:
                    options.warn_unused_cohort_options(x_cos.device.type)
                    u_cos, u_sin = x_cos, x_sin
                    for lin in layer.gated:
                        z_cos, z_sin = lin(u_cos, u_sin)
                        g_cos, g_sin = reference.gate(z_cos, z_sin)
                        u_cos, u_sin = u_cos + g_cos, u_sin + g_sin
                    y_cos, y_sin = layer.out(u_cos, u_sin)
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
        model: an :class:`ECEModel` in float32 or float64.
        atoms: an ``ase.Atoms`` (positions in A, cell, pbc, atomic numbers).
        dtype: None (the model's dtype), or the model's dtype spelt out; any other is
            a TypeError naming the fix, ``model.to(dtype)``.
        device: None (the model's device), or the model's device spelt out; any other
            is a ValueError naming the fix, ``model.to(device)``.
        create_graph: keep the graph of the forces (for a force-loss training step).
    """
    if not isinstance(model, ECEModel):
        raise TypeError(f"model must be an ECEModel, got {type(model).__name__}")
    p = next(model.parameters())
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
            atoms, model.config.cutoff, p.dtype, p.device
        )
    return force_step(model, positions, numbers, graph, create_graph)
