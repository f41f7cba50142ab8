"""Chapter 8's fused edge layer against the reference composition (rotate ->
stack -> unrotate -> aggregate, through D): values in float64 to 1e-12 and in
float32 by the three-way rule, every input's gradient, tails of the tiling, strided
radial weights, determinism and bad inputs. The kernels run in Triton's interpreter
on CPU machines and on the GPU elsewhere."""

import math

import pytest
import torch

from ecekern import reference, so3
from ecekern._triton import AVAILABLE, INTERPRET
from ecekern.edge_frame.launch import pack
from ecekern.edge_layer import BLOCK_E, edge_layer, edge_layer_torch
from ecekern.graph import csr_row_ptr
from ecekern.options import FallbackWarning
from ecekern.testing import assert_close_three_way, rel_err

pytestmark = pytest.mark.skipif(not AVAILABLE, reason="needs Triton")
DEV = "cpu" if INTERPRET else "cuda"
SCALE = 0.3
#: channels of the L = 2 cases: a GPU's product blocks need F = 2C(L+1) to be a
#: multiple of 32; the interpreter takes any width and runs the small one faster
C2 = 4 if INTERPRET else 16


def _case(N=7, E=40, L=2, M=2, C=C2, K=2, dtype=torch.float64, hub=2, seed=0,
          bias=True):  # fmt: skip
    """A random layer: ``hub`` (an atom index, or None) takes half the edges, so its
    segment spans several tiles; atoms 5 and 6 have no in-edges when N = 7."""
    g = torch.Generator().manual_seed(seed)
    S, NA, F, FO = (L + 1) ** 2, M + 1, 2 * C * (L + 1), C * (L + 1)
    dst = torch.randint(0, min(N, 5), (E,), generator=g)
    if hub is not None:
        dst[: E // 2] = hub
    dst = dst.sort().values
    src = torch.randint(0, N, (E,), generator=g)
    D = so3.edge_frames(L, torch.randn(E, 3, generator=g, dtype=torch.float64))

    def rnd(*shape, s=1.0):
        return (s * torch.randn(*shape, generator=g, dtype=torch.float64)).to(
            DEV, dtype
        )

    c = {
        "h": rnd(N, S, C), "D": D.to(DEV, dtype), "rho": rnd(E, F),
        "env": torch.rand(E, generator=g, dtype=torch.float64).to(DEV, dtype),
        "ws": [rnd(NA, F, F, s=F**-0.5) for _ in range(K)],
        "bs": [rnd(F) if bias else None for _ in range(K)],
        "wo": rnd(NA, FO, F, s=F**-0.5), "bo": rnd(FO) if bias else None,
        "src": src.to(DEV), "dst": dst.to(DEV), "rp": csr_row_ptr(dst, N).to(DEV),
        "M": M, "N": N,
    }  # fmt: skip
    c["P"] = pack(c["D"], M)
    return c


def _inputs(c):
    return [c[k] for k in ("h", "P", "rho", "env", "wo", "bo")] + c["ws"] + c["bs"]


def _fused(c, precision="fp32"):
    return edge_layer(c["h"], c["P"], c["rho"], c["env"], c["src"], c["dst"],
                      c["rp"], c["ws"], c["bs"], c["wo"], c["bo"], SCALE,
                      precision)  # fmt: skip


def _reference(c):
    """The model's reference stages, through D (not P)."""
    xc, xs = reference.rotate_and_select(c["h"], c["src"], c["dst"], c["D"], c["M"])
    xc, xs = xc * c["rho"][:, :, None], xs * c["rho"][:, :, None]
    yc, ys = reference.mixing_stack(xc, xs, c["ws"], c["bs"], c["wo"], c["bo"])
    msg = reference.pack_and_unrotate(yc, ys, c["D"], c["M"])
    return reference.aggregate(msg, c["dst"], c["N"], SCALE, c["env"])


SLOW = pytest.mark.slow  # the rest of the cases: the GPU run and `make slow`
CASES = {
    "L2": {},
    "atom-over-three-tiles": {"E": 70},
    "L1": {"L": 1, "M": 1, "C": 8},
    "L2-M1": {"M": 1},
    "one-edge": {"E": 1, "hub": None},
    "no-edges": {"E": 0, "hub": None},
    "K1-no-bias": {"K": 1, "bias": False},
    "whole-tiles": {"E": 3 * BLOCK_E, "hub": None},
    "one-partial-segment": {"E": BLOCK_E + 1, "N": 2, "hub": None},
    "L3": {"L": 3, "M": 2, "C": 4, "E": 20},
}


FAST = ("L2", "atom-over-three-tiles", "one-edge", "no-edges", "L1")


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=SLOW)
                                  for n in CASES])  # fmt: skip
def test_float64_values_match_the_reference_composition(name):
    """Delta to 1e-12 of the reference (through D), and the PyTorch recomputation
    (through P) too, including the tails: no edges, one edge, a segment spanning
    several tiles, tiles of whole segments, atoms without edges."""
    c = _case(**CASES[name])
    if name == "atom-over-three-tiles":  # atom 2's in-edges: 35 in a row
        rp = c["rp"].tolist()
        assert rp[3] // BLOCK_E - rp[2] // BLOCK_E >= 2
    want = _reference(c)
    got = _fused(c)
    assert got.shape == want.shape and got.dtype == torch.float64
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    args = [c[k] for k in ("h", "P", "rho", "env", "src", "dst", "rp", "ws", "bs")]
    again = edge_layer_torch(*args, c["wo"], c["bo"], SCALE)
    torch.testing.assert_close(again, want, atol=1e-12, rtol=0)
    if c["N"] == 7 and CASES[name].get("E", 40):
        assert float(got[5:].abs().max()) == 0.0  # atoms without in-edges


def _grads(c, fn, wrt_weights=False, seed=3):
    """The gradients of ``<fn(c), G>`` in D (through the packing gather for the
    fused layer: masked to the entries P holds), h, rho and env (and the stack's
    parameters with ``wrt_weights``)."""
    D = c["D"].clone().requires_grad_(True)
    others = [c[k].detach().requires_grad_(True) for k in ("h", "rho", "env")]
    params = [t for t in (c["wo"], c["bo"], *c["ws"], *c["bs"]) if t is not None]
    params = [t.detach().requires_grad_(wrt_weights) for t in params]
    c = dict(c, D=D, P=pack(D, c["M"]), h=others[0], rho=others[1], env=others[2],
             wo=params[0], bo=params[1] if c["bo"] is not None else None)  # fmt: skip
    K = len(c["ws"])
    off = 2 if c["bo"] is not None else 1
    c["ws"] = params[off : off + K]
    c["bs"] = params[off + K :] if c["bs"][0] is not None else c["bs"]
    out = fn(c)
    g = torch.Generator().manual_seed(seed)
    G = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out)
    wrt = [D, *others] + (params if wrt_weights else [])
    got = list(torch.autograd.grad(out, wrt, G))
    (held,) = torch.autograd.grad(pack(D, c["M"]).sum(), [D])
    got[0] = got[0] * (held != 0)
    return got


@pytest.mark.parametrize("name", [
    "L2", "no-edges", pytest.param("one-edge", marks=SLOW),
    pytest.param("atom-over-three-tiles", marks=SLOW),
    pytest.param("L1", marks=SLOW), pytest.param("L2-M1", marks=SLOW),
    pytest.param("K1-no-bias", marks=SLOW),
])  # fmt: skip
def test_float64_force_step_gradients_by_the_backward_kernel(name):
    """A force step's gradients (D through P, h, rho, env; no parameter asks for
    one) by the fused backward kernel equal the reference composition's to 1e-12."""
    c = _case(**CASES[name])
    for i, (a, b) in enumerate(zip(_grads(c, _fused), _grads(c, _reference))):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0, msg=f"input {i}")


def test_a_training_step_differentiates_each_input_once():
    """With ``create_graph=True`` (a force-training step) the backward runs in
    PyTorch, loudly; inputs made from each other (the model's rho from the
    envelope) get their gradients once, as the reference's, to 1e-12."""
    c = _case(E=30)
    env = c["env"].detach().requires_grad_(True)
    rho0 = c["rho"]

    def grad_env(fn):
        out = fn(dict(c, env=env, rho=rho0 * env[:, None]))
        G = torch.ones_like(out)
        (g,) = torch.autograd.grad(out, [env], G, create_graph=True)
        return g

    with pytest.warns(FallbackWarning, match="edge_layer backward"):
        got = grad_env(_fused)
    torch.testing.assert_close(got, grad_env(_reference), atol=1e-12, rtol=0)


def test_parameter_gradients_fall_back_loudly_to_pytorch():
    """Asked for the stack's parameter gradients too (training), the backward says
    so once (FallbackWarning) and recomputes in PyTorch: every gradient equals the
    reference's to 1e-12."""
    c = _case(E=30)
    with pytest.warns(FallbackWarning, match="edge_layer backward"):
        got = _grads(c, _fused, wrt_weights=True)
    want = _grads(c, _reference, wrt_weights=True)
    assert len(got) == 4 + 2 + 2 * 2
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0, msg=f"input {i}")


@pytest.mark.slow  # gradgradcheck through the recomputation: a minute
def test_second_derivatives_pass_gradgradcheck():
    """The backward is differentiable (a force-training step): gradgradcheck in
    float64 on a tiny layer."""
    c = _case(N=3, E=5, L=1, M=1, C=8, K=1, hub=None)
    ins = _inputs(c)[:4]

    def fn(h, P, rho, env):
        return edge_layer(h, P, rho, env, c["src"], c["dst"], c["rp"], c["ws"],
                          c["bs"], c["wo"], c["bo"], SCALE)  # fmt: skip

    with pytest.warns(FallbackWarning, match="second derivative"):
        assert torch.autograd.gradgradcheck(
            fn, [t.detach().requires_grad_(True) for t in ins], atol=1e-8
        )


@pytest.mark.parametrize("precision", ["fp32", pytest.param("3xtf32", marks=SLOW),
                         pytest.param("tf32", marks=SLOW),
                         pytest.param("bf16", marks=SLOW)])  # fmt: skip
def test_float32_by_the_three_way_rule(precision):
    """float32 in each precision: the strict and 3xTF32 products within the
    three-way rule of the float32 reference; TF32 and bf16 within their stated
    relative errors (5e-3 and 3e-2)."""
    c64 = _case(E=45)
    c32 = {k: (v.float() if torch.is_tensor(v) and v.is_floating_point() else
               [t if t is None else t.float() for t in v] if isinstance(v, list)
               else v) for k, v in c64.items()}  # fmt: skip
    want = _reference(c64)
    got = _fused(c32, precision)
    assert got.dtype == torch.float32
    if precision in ("fp32", "3xtf32"):
        assert_close_three_way(got, _reference(c32), want, precision)
    else:
        assert rel_err(got, want) < {"tf32": 5e-3, "bf16": 3e-2}[precision]


def test_strided_radial_weights_and_determinism():
    """rho as a column slice of a wider radial output (as the model's per-layer
    chunk is) gives the same Delta as a contiguous copy, bitwise, and two runs are
    bitwise equal (no atomics)."""
    c = _case(E=20)
    wide = torch.randn(20, 3 * c["rho"].shape[1], dtype=torch.float64).to(DEV)
    strided = wide[:, 5 : 5 + c["rho"].shape[1]]
    assert not strided.is_contiguous()
    a = _fused(dict(c, rho=strided))
    b = _fused(dict(c, rho=strided.contiguous()))
    assert torch.equal(a, b) and torch.equal(a, _fused(dict(c, rho=strided)))


@SLOW
def test_the_backward_is_bitwise_deterministic():
    """Two force-step backwards of one layer give bitwise equal gradients (the dst
    and src reductions run in a fixed order; no atomics)."""
    c = _case(E=40)
    g1, g2 = _grads(c, _fused), _grads(c, _fused)
    assert all(torch.equal(x, y) for x, y in zip(g1, g2))


def test_bad_inputs_are_clear_errors():
    """Shapes, dtypes, an unknown precision and half precision are refused with the
    input named."""
    c = _case(E=10)
    with pytest.raises(ValueError, match="precision"):
        _fused(c, "fp16")
    with pytest.raises(ValueError, match="rho"):
        _fused(dict(c, rho=c["rho"][:, :-1]))
    with pytest.raises(TypeError, match="env"):
        _fused(dict(c, env=c["env"].float()))
    with pytest.raises(ValueError, match="gated weights"):
        _fused(dict(c, ws=[w[:, :-1] for w in c["ws"]]))
    with pytest.raises(ValueError, match="src"):
        _fused(dict(c, src=c["src"].int()))
    with pytest.raises(ValueError, match="C' = C"):
        _fused(dict(c, wo=c["wo"][:, :-3], bo=c["bo"][:-3]))
    with pytest.raises(TypeError, match="weights"):
        _fused(dict(c, ws=[w.float() for w in c["ws"]]))
    half = {k: (v.half() if torch.is_tensor(v) and v.is_floating_point() else
                [t if t is None else t.half() for t in v] if isinstance(v, list)
                else v) for k, v in c.items()}  # fmt: skip
    with pytest.raises(ValueError, match="float16"):
        _fused(half)
    assert math.isfinite(float(_fused(c).sum()))


@pytest.mark.parametrize("edge_frame", ["reference", "packed"])
def test_the_model_with_the_edge_layer_equals_the_reference(edge_frame):
    """A float64 force step with ``edge_layer="triton"`` (P packed from D, or the
    edge-frame kernels' tiles) gives the reference's energy and forces to 1e-12."""
    import ecekern
    from ecekern.model import force_step, prepare_inputs

    cfg = ecekern.ECEConfig(lmax=1, channels=2, n_gated=1, cutoff=2.0,
                            radial_hidden=4, readout_hidden=2,
                            avg_num_neighbors=4.0)  # fmt: skip
    model = ecekern.ECEModel(cfg).double().to(DEV)
    atoms = ecekern.systems.diamond(1)
    atoms.rattle(0.05, seed=1)
    inputs = prepare_inputs(atoms, cfg.cutoff, torch.float64, DEV)
    with ecekern.options.use(reference=True):
        e0, f0 = force_step(model, *inputs)
    with ecekern.options.use(edge_layer="triton", edge_frame=edge_frame):
        assert model.plan().edge_layer == "triton"
        e1, f1 = force_step(model, *inputs)
    assert float(e1) == pytest.approx(float(e0), abs=1e-12)
    torch.testing.assert_close(f1, f0, atol=1e-12, rtol=0)
