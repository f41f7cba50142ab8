"""The peers a user would reach for, at the same width and degree as the reference.

* ``torch.compile`` of :class:`ecekern.ECEModel` (no code: ``torch.compile(model)``);
* :class:`E3nnConvModel`: a NequIP-style e3nn tensor-product convolution;
* :class:`CueqConvModel`: the same convolution through NVIDIA cuEquivariance, with the
  gather, tensor product and scatter fused in one ``cuet.ChannelWiseTensorProduct``.

The e3nn model has the same graph, radial basis, cutoff, channels C and degree L, and
the same number of interaction layers as :class:`ecekern.ECEConfig`: node features
``C x (0e + 1o + 2e + ...)``; per layer ``h <- h + Linear(k * sum_e TP(Linear(h)[src_e],
Y(u_e), w(d_e)))`` with a ``uvu`` tensor product whose per-edge weights come from a
radial MLP (NequIP's convolution). NequIP's gate nonlinearity is left out: it is an
elementwise op that costs little next to the tensor product this peer is here to time.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from .graph import Graph, edge_vectors
from .model import ECEConfig, _silu_mlp, species_table
from .reference import envelope, radial_basis

__all__ = ["CueqConvModel", "E3nnConvModel", "graphed_force_step"]


class E3nnConvModel(nn.Module):
    """NequIP-style e3nn convolution: ``forward(positions, numbers, graph) -> E``."""

    def __init__(self, config: ECEConfig | None = None):
        super().__init__()
        from e3nn import o3

        cfg = config if config is not None else ECEConfig()
        self.config = cfg
        C, L = cfg.channels, cfg.lmax
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            self.irreps_node = o3.Irreps([(C, (l, (-1) ** l)) for l in range(L + 1)])
            self.irreps_sh = o3.Irreps.spherical_harmonics(L)
            self.embedding = nn.Embedding(len(cfg.species), C)
            self.lin_in = nn.ModuleList()
            self.tps = nn.ModuleList()
            self.radial = nn.ModuleList()
            self.lin_out = nn.ModuleList()
            for _ in range(cfg.n_interactions):
                mid, instructions = [], []
                for i, (mul, ir_in) in enumerate(self.irreps_node):
                    for j, (_, ir_sh) in enumerate(self.irreps_sh):
                        for ir_out in ir_in * ir_sh:
                            if ir_out in self.irreps_node:
                                instructions.append((i, j, len(mid), "uvu", True))
                                mid.append((mul, ir_out))
                tp = o3.TensorProduct(
                    self.irreps_node,
                    self.irreps_sh,
                    o3.Irreps(mid),
                    instructions,
                    shared_weights=False,
                    internal_weights=False,
                )
                self.lin_in.append(o3.Linear(self.irreps_node, self.irreps_node))
                self.tps.append(tp)
                self.radial.append(
                    _silu_mlp(
                        [
                            cfg.n_rbf,
                            cfg.radial_hidden,
                            cfg.radial_hidden,
                            tp.weight_numel,
                        ]
                    )
                )
                self.lin_out.append(o3.Linear(o3.Irreps(mid), self.irreps_node))
            self.readout = _silu_mlp([C, cfg.readout_hidden, 1])
        self.register_buffer("_species_index", species_table(cfg), persistent=False)

    def forward(self, positions: torch.Tensor, numbers: torch.Tensor, graph: Graph):
        from e3nn import o3

        cfg = self.config
        C = cfg.channels
        species = self._species_index[numbers + 1]
        r = edge_vectors(positions, graph)
        d = torch.linalg.vector_norm(r, dim=-1)
        rbf = radial_basis(d, cfg.n_rbf, cfg.cutoff)
        env = envelope(d, cfg.cutoff)[:, None]
        Y = o3.spherical_harmonics(
            self.irreps_sh, r, normalize=True, normalization="component"
        )
        N = positions.shape[0]
        h = torch.cat(
            [self.embedding(species), positions.new_zeros(N, self.irreps_node.dim - C)],
            dim=1,
        )
        for lin_in, tp, radial, lin_out in zip(
            self.lin_in, self.tps, self.radial, self.lin_out
        ):
            m = tp(lin_in(h)[graph.src], Y, radial(rbf) * env)
            agg = m.new_zeros(N, m.shape[1]).index_add_(0, graph.dst, m * cfg.scale)
            h = h + lin_out(agg)
        return self.readout(h[:, :C]).sum()


class CueqConvModel(nn.Module):
    """The convolution of :class:`E3nnConvModel` through cuEquivariance (0.13):
    ``forward(positions, numbers, graph) -> E``.

    Node features ``C x (0e + 1o + 2e + ...)`` (``cue.Irreps("O3", ...)``) are stored in
    the ``cue.ir_mul`` layout, the one cuEquivariance's descriptors use inside, so no
    layout transposes run: the block of degree l is ``(2l+1, C)`` row-major, and the
    first C entries are the scalars (the embedding in, the readout out). Per layer
    ``h <- h + Linear_out(TP(Linear_in(h), Y, w))``, where one
    ``cuet.ChannelWiseTensorProduct`` call gathers ``Linear_in(h)`` by ``graph.src``
    (``indices_1``), takes the channel-wise (``uvu``) product with ``Y(r_e)`` under
    the per-edge weights ``w = MLP(rbf) * envelope * k``, and scatter-adds the messages
    into ``graph.dst`` (``indices_out``, ``size_out=N``). ``Y`` comes from
    ``cuet.SphericalHarmonics`` (normalised vectors, e3nn's "component" norm), the
    linears are ``cuet.Linear``; their weights are this module's parameters (drawn from
    ``config.seed``) passed in at each call.

    The cuet kernels are built lazily, at the first forward on each (device, dtype),
    from the input's device, and cached (not part of ``state_dict``). So
    ``CueqConvModel(cfg).to("cuda")`` gets the CUDA kernels. On CUDA the default
    methods are :attr:`CUDA_METHODS` (``uniform_1d`` for the spherical harmonics and
    the tensor product, ``fused_tp`` for the linears); elsewhere every op is
    ``"naive"`` (cuet's PyTorch einsum path, which needs no ``cuequivariance_ops_torch``
    and runs float64). ``methods`` overrides some of them, e.g.
    ``{"linear": "naive"}``, or ``{"sh": "naive", "tp": "naive", "linear": "naive"}``.
    """

    CUDA_METHODS = {"sh": "uniform_1d", "tp": "uniform_1d", "linear": "fused_tp"}
    CPU_METHODS = {"sh": "naive", "tp": "naive", "linear": "naive"}

    def __init__(
        self,
        config: ECEConfig | None = None,
        methods: Mapping[str, str] | None = None,
    ):
        super().__init__()
        import cuequivariance as cue

        cfg = config if config is not None else ECEConfig()
        self.config = cfg
        unknown = set(methods or {}) - set(self.CUDA_METHODS)
        if unknown:
            raise ValueError(
                f"methods keys must be among {sorted(self.CUDA_METHODS)}, "
                f"got {sorted(unknown)}"
            )
        self.methods = dict(methods or {})
        C, L = cfg.channels, cfg.lmax
        parity = lambda l: "e" if l % 2 == 0 else "o"
        self.irreps_node = cue.Irreps(
            "O3", " + ".join(f"{C}x{l}{parity(l)}" for l in range(L + 1))
        )
        self.irreps_sh = cue.Irreps(
            "O3", " + ".join(f"1x{l}{parity(l)}" for l in range(L + 1))
        )
        self.layout = cue.ir_mul
        # the output irreps keep the products that are node irreps (as the e3nn peer)
        self.filter_irreps_out = [ir for _, ir in self.irreps_node]
        tp_desc = cue.descriptors.channelwise_tensor_product(
            self.irreps_node, self.irreps_sh, self.filter_irreps_out
        )
        self.irreps_mid = tp_desc.outputs[0].irreps
        self.tp_weight_numel = tp_desc.inputs[0].dim
        n_in = cue.descriptors.linear(self.irreps_node, self.irreps_node).inputs[0].dim
        n_out = cue.descriptors.linear(self.irreps_mid, self.irreps_node).inputs[0].dim
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            self.embedding = nn.Embedding(len(cfg.species), C)
            self.lin_in_weight = nn.ParameterList()
            self.radial = nn.ModuleList()
            self.lin_out_weight = nn.ParameterList()
            for _ in range(cfg.n_interactions):
                # cuet.Linear draws its own weights from randn and normalises by path
                self.lin_in_weight.append(nn.Parameter(torch.randn(1, n_in)))
                self.radial.append(
                    _silu_mlp(
                        [
                            cfg.n_rbf,
                            cfg.radial_hidden,
                            cfg.radial_hidden,
                            self.tp_weight_numel,
                        ]
                    )
                )
                self.lin_out_weight.append(nn.Parameter(torch.randn(1, n_out)))
            self.readout = _silu_mlp([C, cfg.readout_hidden, 1])
        self.register_buffer("_species_index", species_table(cfg), persistent=False)
        self._kernels: dict = {}  # (device, dtype) -> cuet modules; not in state_dict

    def methods_for(self, device: torch.device) -> dict[str, str]:
        """The cuet method of each op (``sh``, ``tp``, ``linear``) on ``device``."""
        device = torch.device(device)
        base = self.CUDA_METHODS if device.type == "cuda" else self.CPU_METHODS
        return {**base, **self.methods}

    def _kernels_for(self, x: torch.Tensor) -> dict:
        key = (x.device, x.dtype)
        kernels = self._kernels.get(key)
        if kernels is None:
            kernels = self._build_kernels(x.device, x.dtype)
            self._kernels[key] = kernels
        return kernels

    def _build_kernels(self, device: torch.device, dtype: torch.dtype) -> dict:
        import cuequivariance_torch as cuet

        m = self.methods_for(device)
        # fused_tp fixes its math dtype at build time; the others follow the inputs
        fixed = lambda method: dtype if method == "fused_tp" else None

        def linear(irreps_in):
            return cuet.Linear(
                irreps_in,
                self.irreps_node,
                layout=self.layout,
                shared_weights=True,
                internal_weights=False,
                device=device,
                dtype=dtype,
                math_dtype=fixed(m["linear"]),
                method=m["linear"],
            )

        sh = cuet.SphericalHarmonics(
            list(range(self.config.lmax + 1)),
            normalize=True,
            device=device,
            math_dtype=fixed(m["sh"]),
            method=m["sh"],
        )
        tps, lin_in, lin_out = [], [], []
        for _ in range(self.config.n_interactions):
            tp = cuet.ChannelWiseTensorProduct(
                self.irreps_node,
                self.irreps_sh,
                self.filter_irreps_out,
                layout=self.layout,
                shared_weights=False,
                internal_weights=False,
                device=device,
                dtype=dtype,
                math_dtype=fixed(m["tp"]),
                method=m["tp"],
            )
            if tp.irreps_out != self.irreps_mid or tp.weight_numel != (
                self.tp_weight_numel
            ):
                raise RuntimeError("cuet.ChannelWiseTensorProduct: unexpected irreps")
            tps.append(tp)
            lin_in.append(linear(self.irreps_node))
            lin_out.append(linear(self.irreps_mid))
        return {"sh": sh, "tp": tps, "lin_in": lin_in, "lin_out": lin_out}

    def forward(self, positions: torch.Tensor, numbers: torch.Tensor, graph: Graph):
        cfg = self.config
        C = cfg.channels
        kernels = self._kernels_for(positions)
        species = self._species_index[numbers + 1]
        r = edge_vectors(positions, graph)
        d = torch.linalg.vector_norm(r, dim=-1)
        rbf = radial_basis(d, cfg.n_rbf, cfg.cutoff)
        # k = cfg.scale is folded into the per-edge weights (the TP is linear in them)
        env_k = envelope(d, cfg.cutoff)[:, None] * cfg.scale
        Y = kernels["sh"](r)
        N = positions.shape[0]
        h = torch.cat(
            [self.embedding(species), positions.new_zeros(N, self.irreps_node.dim - C)],
            dim=1,
        )
        for tp, lin_in, lin_out, w_in, radial, w_out in zip(
            kernels["tp"],
            kernels["lin_in"],
            kernels["lin_out"],
            self.lin_in_weight,
            self.radial,
            self.lin_out_weight,
        ):
            agg = tp(
                lin_in(h, weight=w_in),
                Y,
                weight=radial(rbf) * env_k,
                indices_1=graph.src,
                indices_out=graph.dst,
                size_out=N,
            )
            h = h + lin_out(agg, weight=w_out)
        return self.readout(h[:, :C]).sum()


def graphed_force_step(model, positions, numbers, graph, warmup: int = 3):
    """The force step (:func:`ecekern.model.force_step`) of any ``model(positions,
    numbers, graph) -> energy``, captured as one CUDA graph with
    ``torch.cuda.graph`` after ``warmup`` eager steps on a side stream.

    Returns ``step(positions=None) -> (energy, forces)``: a replay on the captured
    atoms and graph (new ``positions``, same shape, are copied in first); the
    outputs are the graph's own tensors, overwritten by the next replay. Raises
    ``RuntimeError`` when ``positions`` are not on a CUDA device; a model whose
    step syncs with the host fails in the capture with torch's error."""
    from .model import force_step

    if not isinstance(positions, torch.Tensor) or positions.device.type != "cuda":
        where = getattr(positions, "device", type(positions).__name__)
        raise RuntimeError(f"CUDA graphs need positions on a CUDA device, got {where}")
    static = positions.detach().clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            force_step(model, static, numbers, graph)
    torch.cuda.current_stream().wait_stream(side)
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):
        out = force_step(model, static, numbers, graph)

    def step(new_positions=None):
        if new_positions is not None:
            static.copy_(new_positions)
        cuda_graph.replay()
        return out

    return step
