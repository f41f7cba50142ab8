"""The cuEquivariance peer (:class:`ecekern.peers.CueqConvModel`): symmetry and the
fused gather/scatter. Skipped where ``cuequivariance_torch`` is not installed; on the
CPU it runs cuet's ``naive`` (PyTorch) methods in float64."""

import pytest
import torch

import ecekern
from ecekern.model import force_step, prepare_inputs
from ecekern.testing import random_rotation, rel_err, rotated_atoms

pytest.importorskip("cuequivariance_torch")

from ecekern.peers import CueqConvModel  # noqa: E402

SMALL = ecekern.ECEConfig(channels=6, radial_hidden=16, readout_hidden=8)
G = lambda s: torch.Generator().manual_seed(s)


@pytest.fixture(scope="module")
def box():
    return ecekern.systems.diamond(1)


def _symmetry_errors(model, atoms, dtype, device="cpu", seed=9):
    cutoff = model.config.cutoff
    pos, numbers, graph = prepare_inputs(atoms, cutoff, dtype, device)
    e, f = force_step(model, pos, numbers, graph)
    R = random_rotation(G(seed))
    pos_r, numbers_r, graph_r = prepare_inputs(
        rotated_atoms(atoms, R), cutoff, dtype, device
    )
    e_r, f_r = force_step(model, pos_r, numbers_r, graph_r)
    assert f.abs().max() > 0
    return rel_err(e_r, e), rel_err(f_r, f @ R.T.to(f))


@pytest.mark.parametrize(
    "cfg",
    [
        SMALL,
        ecekern.ECEConfig(
            lmax=3, channels=4, n_interactions=1, radial_hidden=8, readout_hidden=4
        ),
    ],
    ids=["L2", "L3"],
)
def test_cueq_peer_is_invariant_float64(box, cfg):
    model = CueqConvModel(cfg).double()
    e_err, f_err = _symmetry_errors(model, box, torch.float64)
    assert e_err < 1e-10 and f_err < 1e-10


def test_cueq_peer_float32_agrees_with_float64(box):
    model = CueqConvModel(SMALL)
    e_err, f_err = _symmetry_errors(model, box, torch.float32)
    assert e_err < 1e-5 and f_err < 1e-3
    pos, numbers, graph = prepare_inputs(box, SMALL.cutoff, torch.float32)
    e32, f32 = force_step(model, pos, numbers, graph)
    model.double()
    e64, f64 = force_step(model, pos.double(), numbers, graph)
    assert rel_err(e32, e64) < 1e-5 and rel_err(f32, f64) < 1e-3


def test_cueq_peer_methods_and_kernel_cache(box):
    model = CueqConvModel(SMALL).double()
    assert set(model.methods_for("cpu").values()) == {"naive"}
    assert model.methods_for("cuda") == CueqConvModel.CUDA_METHODS
    naive = CueqConvModel(SMALL, methods={"linear": "naive"})
    assert naive.methods_for("cuda")["linear"] == "naive"
    with pytest.raises(ValueError, match="methods"):
        CueqConvModel(SMALL, methods={"gate": "naive"})
    pos, numbers, graph = prepare_inputs(box, SMALL.cutoff)
    model(pos, numbers, graph)
    assert list(model._kernels) == [(pos.device, torch.float64)]
    # the cuet kernels hold no parameters: all weights are the model's own
    assert all(not k.startswith("_kernels") for k in model.state_dict())


def _fused_vs_unfused(model, pos, numbers, graph):
    """One layer's fused gather/TP/scatter against gather, TP, index_add by hand."""
    kernels = model._kernels_for(pos)
    tp, lin_in = kernels["tp"][0], kernels["lin_in"][0]
    N, E = pos.shape[0], graph.n_edges
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, model.irreps_node.dim, generator=g, dtype=torch.float64)
    w = torch.randn(E, model.tp_weight_numel, generator=g, dtype=torch.float64)
    x, w = x.to(pos), w.to(pos)
    x = lin_in(x, weight=model.lin_in_weight[0])
    Y = kernels["sh"](pos[graph.src] - pos[graph.dst] + 0.1)
    fused = tp(x, Y, weight=w, indices_1=graph.src, indices_out=graph.dst, size_out=N)
    per_edge = tp(x[graph.src], Y, weight=w)
    by_hand = per_edge.new_zeros(N, per_edge.shape[1]).index_add_(
        0, graph.dst, per_edge
    )
    return rel_err(fused, by_hand)


def test_cueq_fused_gather_scatter_matches_index_add(box):
    model = CueqConvModel(SMALL).double()
    pos, numbers, graph = prepare_inputs(box, SMALL.cutoff)
    assert _fused_vs_unfused(model, pos, numbers, graph) < 1e-12


@pytest.mark.gpu
def test_cueq_peer_on_gpu_matches_cpu(box):
    """The CUDA methods (uniform_1d, fused_tp) against cuet's naive ones on the CPU,
    float32 on the GPU against float64 on the CPU, and invariance on the GPU."""
    model = CueqConvModel(SMALL).double()
    pos, numbers, graph = prepare_inputs(box, SMALL.cutoff)
    e64, f64 = force_step(model, pos, numbers, graph)
    model.to(device="cuda", dtype=torch.float32)
    p32, n32, g32 = prepare_inputs(box, SMALL.cutoff, torch.float32, "cuda")
    e32, f32 = force_step(model, p32, n32, g32)
    assert rel_err(e32, e64) < 1e-5 and rel_err(f32, f64) < 1e-3
    e_err, f_err = _symmetry_errors(model, box, torch.float32, "cuda")
    assert e_err < 1e-5 and f_err < 1e-3
    assert _fused_vs_unfused(model, p32, n32, g32) < 1e-5
