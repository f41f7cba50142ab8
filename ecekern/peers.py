"""The peers a user would reach for, at the same width and degree as the reference.

* ``torch.compile`` of :class:`ecekern.ECEModel` (no code: ``torch.compile(model)``);
* :class:`E3nnConvModel`: a NequIP-style e3nn tensor-product convolution.

The e3nn model has the same graph, radial basis, cutoff, channels C and degree L, and
the same number of interaction layers as :class:`ecekern.ECEConfig`: node features
``C x (0e + 1o + 2e + ...)``; per layer ``h <- h + Linear(k * sum_e TP(Linear(h)[src_e],
Y(u_e), w(d_e)))`` with a ``uvu`` tensor product whose per-edge weights come from a
radial MLP (NequIP's convolution). NequIP's gate nonlinearity is left out: it is an
elementwise op that costs little next to the tensor product this peer is here to time.
"""

from __future__ import annotations

import torch
from torch import nn

from .graph import Graph, edge_vectors
from .model import ECEConfig, _silu_mlp, species_table
from .reference import envelope, radial_basis

__all__ = ["E3nnConvModel"]


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
        species = self._species_index[numbers]
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
