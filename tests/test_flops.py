"""The FLOP model of a force step against the FLOP counted op by op."""

import pytest
import torch

import ecekern
from ecekern import options, reference
from ecekern.flops import counted_flops, step_flops
from ecekern.model import force_step, prepare_inputs

CFG = ecekern.ECEConfig(channels=4, radial_hidden=8, readout_hidden=8, cutoff=2.0)


def test_linears_cost_twice_their_forward_in_a_force_step():
    """A product of a weight and an activation: the forward and the activation's
    gradient, never the weight's (2 * 2 * F_in * F_out * n_ang per row pair)."""
    E, F_in, F_out, n_ang = 7, 12, 5, 3
    x = torch.randn(E, F_in, n_ang, dtype=torch.float64, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(n_ang, F_out, F_in, dtype=torch.float64))

    def step():
        y_cos, y_sin = reference.equivariant_linear(x, x, w, None)
        torch.autograd.grad((y_cos.sum() + y_sin.sum()), x)

    assert counted_flops(step) == 2 * (2 * 2 * E * F_in * F_out * n_ang)


def test_step_model_matches_the_counted_reference_step():
    """The reference's force step counted op by op is the model's total within 5 %
    (the model leaves out the Wigner blocks' small products)."""
    inputs = prepare_inputs(ecekern.systems.diamond(1), CFG.cutoff, torch.float64)
    model = ecekern.ECEModel(CFG).double()
    with options.use(reference=True):
        counted = counted_flops(lambda: force_step(model, *inputs))
    f = step_flops(CFG, inputs[0].shape[0], inputs[2].n_edges)
    assert f["total"] == sum(v for k, v in f.items() if k != "total")
    assert f["total"] == pytest.approx(counted, rel=0.05)


def test_book_model_linears_dominate():
    f = step_flops(ecekern.ECEConfig(), 4096, 365074)
    assert f["linears"] / f["total"] > 0.9


def test_bad_input():
    with pytest.raises(TypeError, match="ECEConfig"):
        step_flops({}, 1, 1)
    with pytest.raises(ValueError, match="n_edges"):
        step_flops(CFG, 1, -1)
    with pytest.raises(TypeError, match="callable"):
        counted_flops(3)


def test_graphed_force_step_needs_a_cuda_device():
    """A peer's replay (chapter 1's progress table) says why it cannot run here."""
    from ecekern.peers import graphed_force_step

    inputs = prepare_inputs(ecekern.systems.diamond(1), CFG.cutoff, torch.float32)
    model = ecekern.ECEModel(CFG)
    if torch.cuda.is_available():
        pytest.skip("a CUDA device: the replay runs")
    with pytest.raises(RuntimeError, match="CUDA graphs need positions on a CUDA"):
        graphed_force_step(model, *inputs)


def test_stage_costs_split_the_step_model_and_grow_with_the_graph():
    """The stages' FLOP add up to :func:`step_flops`' total; bytes grow linearly
    with edges and atoms; the folded passes (edge_frames, radial_modulation,
    aggregate) cost nothing of their own; bad sizes are errors."""
    from ecekern.flops import STAGES, stage_costs

    cfg = ecekern.ECEConfig()
    one = stage_costs(cfg, 64, 1000)
    two = stage_costs(cfg, 128, 2000)
    assert tuple(one) == STAGES
    assert sum(v["flop"] for v in one.values()) == step_flops(cfg, 64, 1000)["total"]
    for s in STAGES:
        assert two[s]["bytes"] == 2 * one[s]["bytes"]
        assert two[s]["flop"] == 2 * one[s]["flop"]
    for s in ("edge_frames", "radial_modulation", "aggregate"):
        assert one[s] == {"flop": 0, "bytes": 0}
    # the stack moves more than any other stage: X in and Y out, twice
    assert max(one, key=lambda s: one[s]["bytes"]) == "mixing_stack"
    with pytest.raises(ValueError, match="n_edges"):
        stage_costs(cfg, 64, -1)
