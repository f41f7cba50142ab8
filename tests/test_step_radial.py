import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ecekern import reference
from ecekern._triton import INTERPRET
from ecekern.config import ECEConfig
from ecekern.model import ECEModel
from ecekern.options import FallbackWarning
from ecekern.step import radial as R
from ecekern.testing import assert_close_three_way, rel_err

# the fused op runs in the interpreter on CPU machines and on the GPU elsewhere: the
# same tests, on whichever device serves the kernels here
DEV = "cpu" if INTERPRET else "cuda"
CUTOFF = 5.0
SMALL = (8, 24, 20, 40)  # n_rbf, H1, H2, O: small widths for the interpreter


def _weights(sizes=SMALL, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        W = torch.randn(b, a, generator=g, dtype=torch.float64) / a**0.5
        bias = 0.3 * torch.randn(b, generator=g, dtype=torch.float64)
        out.append(tuple(t.to(DEV, dtype).requires_grad_() for t in (W, bias)))
    return out


def _lengths(E, dtype=torch.float64, seed=1, hi=CUTOFF):
    g = torch.Generator().manual_seed(seed)
    d = 0.4 + (hi - 0.4) * torch.rand(E, generator=g, dtype=torch.float64)
    return d.to(DEV, dtype).requires_grad_()


def _params(ws):
    return [t for pair in ws for t in pair]


def _run(fn, d, ws, n_rbf=SMALL[0], precision="fp32", seed=2, wrt_weights=False):
    """``fn``'s output and the gradients of ``<out, G>`` (d's, and the weights')."""
    out = fn(d, ws, CUTOFF, n_rbf, precision)
    G = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed),
                    dtype=torch.float64).to(out.device, out.dtype)  # fmt: skip
    wrt = [d, *_params(ws)] if wrt_weights else [d]
    return out, *torch.autograd.grad(out, wrt, G)


def _ref(d, ws, cutoff, n_rbf, precision="fp32"):
    return R.radial_reference(d, ws, cutoff, n_rbf)


class _Ops(TorchDispatchMode):
    """Records the names of the ops dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("E", [0, 1, 37, 64, 130], ids=lambda E: f"E{E}")
def test_fp64_matches_reference(E):
    d, ws = _lengths(E), _weights()
    got, ref = _run(R.radial, d, ws), _run(_ref, d, ws)
    assert got[0].shape == (E, SMALL[-1])
    for a, b in zip(got, ref, strict=True):
        assert rel_err(a, b) < 1e-12


@pytest.mark.parametrize(
    "sizes", [(3, 17, 33, 5), (1, 16, 16, 100), (16, 40, 9, 64), (20, 128, 70, 130)],
    ids=["odd", "rbf1-O100", "O64", "wide"],
)  # fmt: skip
def test_fp64_awkward_widths(sizes):
    """Widths that are not powers of two (padded), O past one column block, and the
    largest hidden width the kernels take."""
    d, ws = _lengths(41), _weights(sizes)
    got = _run(R.radial, d, ws, n_rbf=sizes[0])
    ref = _run(_ref, d, ws, n_rbf=sizes[0])
    for a, b in zip(got, ref, strict=True):
        assert rel_err(a, b) < 1e-12


def test_edges_past_the_cutoff_are_exactly_zero():
    """Lengths at and past r_c (padding edges sit at 2 r_c): the envelope is zero, so
    radial and d's gradient are zero there, whatever the MLP's biases give."""
    d = _lengths(50, hi=1.5 * CUTOFF).detach()
    d[[3, 7, 40]] = torch.tensor([CUTOFF, 2 * CUTOFF, 1.2 * CUTOFF], dtype=d.dtype)
    d.requires_grad_()
    ws = _weights()
    got, gd = _run(R.radial, d, ws)
    ref, gr = _run(_ref, d, ws)
    out = d.detach() >= CUTOFF
    assert out.sum() > 10
    assert got[out].abs().max() == 0 and gd[out].abs().max() == 0
    assert got[~out].abs().min() > 0
    assert rel_err(got, ref) < 1e-12 and rel_err(gd, gr) < 1e-12


def test_book_sizes():
    """The chapter's widths (n_rbf 8, hidden 64, O = 448) with the model's own MLP:
    what ``ECEModel.atom_energies`` computes today."""
    cfg = ECEConfig()
    mlp = ECEModel(cfg).radial.to(DEV, torch.float64)
    ws = [(lin.weight, lin.bias) for lin in mlp[::2]]
    assert [ws[0][0].shape[1]] + [W.shape[0] for W, _ in ws] == [8, 64, 64, 448]
    d = _lengths(45)
    rbf = reference.radial_basis(d, cfg.n_rbf, cfg.cutoff)
    model = mlp(rbf) * reference.envelope(d, cfg.cutoff)[:, None]
    got = R.radial(d, ws, cfg.cutoff, cfg.n_rbf)
    assert rel_err(got, model) < 1e-12
    G = torch.randn_like(model)
    (gd,) = torch.autograd.grad(got, d, G)
    (gr,) = torch.autograd.grad(model, d, G)
    assert rel_err(gd, gr) < 1e-12


@pytest.mark.parametrize("precision", ["fp32", "3xtf32"])
def test_fp32_three_way(precision):
    """float32 against float64: the kernel's error at most twice PyTorch's own in
    float32, plus 1e-6 (values and d's gradient)."""
    d64, ws64 = _lengths(90), _weights()
    d32 = d64.detach().float().requires_grad_()
    ws32 = [tuple(t.detach().float().requires_grad_() for t in p) for p in ws64]
    truth = _run(_ref, d64, ws64)
    got = _run(R.radial, d32, ws32, precision=precision)
    ref32 = _run(_ref, d32, ws32)
    for a, b, t in zip(got, ref32, truth, strict=True):
        assert_close_three_way(a, b, t, f"radial {precision}")


def test_non_contiguous_lengths_and_gradients():
    """d a strided view; the output's gradient transposed, and expanded (stride 0)."""
    ws = _weights()
    base = _lengths(80)
    d = base[::2]
    assert not d.is_contiguous()
    out, ref = R.radial(d, ws, CUTOFF, 8), _ref(d, ws, CUTOFF, 8)
    assert rel_err(out, ref) < 1e-12
    Gt = torch.randn(out.shape[1], out.shape[0], dtype=out.dtype, device=DEV).T
    for G in (Gt, torch.ones((), dtype=out.dtype, device=DEV).expand(out.shape)):
        (a,) = torch.autograd.grad(out, base, G, retain_graph=True)
        (b,) = torch.autograd.grad(ref, base, G, retain_graph=True)
        assert rel_err(a, b) < 1e-12


def test_force_step_runs_the_backward_kernel_alone():
    """``autograd.grad(out, d)`` with weights that require grad (a force step) runs
    the backward kernel and no product of the weights' gradients; ``backward()``
    runs the kernel for d and PyTorch's products for the weights, and agrees."""
    d, ws = _lengths(30), _weights()
    out = R.radial(d, ws, CUTOFF, 8)
    with _Ops() as ops:
        (gd,) = torch.autograd.grad(out.sum(), d, retain_graph=True)
    assert "ecekern.radial_bwd_d.default" in ops.names
    assert not [n for n in ops.names if "mm" in n]
    with _Ops() as ops:
        out.sum().backward()
    assert "ecekern.radial_bwd_d.default" in ops.names
    assert [n for n in ops.names if "mm" in n]
    assert torch.equal(d.grad, gd) and ws[0][0].grad is not None


def test_weight_gradients_match_reference():
    d, ws = _lengths(37), _weights()
    got = _run(R.radial, d, ws, wrt_weights=True)
    ref = _run(_ref, d, ws, wrt_weights=True)
    for a, b in zip(got, ref, strict=True):
        assert rel_err(a, b) < 1e-12


def test_gradcheck_and_force_training_second_derivative():
    """gradcheck, gradgradcheck, and a force-training step: ``F = -dE/dd`` with
    ``create_graph``, then a loss on F differentiated to the weights."""
    sizes = (4, 16, 16, 3)
    d, ws = _lengths(5), _weights(sizes)
    (W1, b1), (W2, b2), (W3, b3) = ws
    # d, and a bias at each end (every parameter: a minute in the interpreter)
    f = lambda d, b1, b3: R.radial(d, [(W1, b1), (W2, b2), (W3, b3)], CUTOFF, 4)
    assert torch.autograd.gradcheck(f, (d, b1, b3))
    assert torch.autograd.gradgradcheck(f, (d, b1, b3), fast_mode=True)

    def force_loss(fn):
        energy = (fn(d, ws, CUTOFF, 4) ** 2).sum()
        (forces,) = torch.autograd.grad(energy, d, create_graph=True)
        return torch.autograd.grad((forces**2).sum(), _params(ws))

    for a, b in zip(force_loss(R.radial), force_loss(_ref), strict=True):
        assert rel_err(a, b) < 1e-12


def test_custom_ops_pass_opcheck_and_compile():
    d, ws = _lengths(20), _weights()
    p = [t.detach() for t in _params(ws)]
    args = (d.detach(), *p, CUTOFF, "fp32")
    G = torch.randn(20, SMALL[-1], dtype=d.dtype, device=DEV)
    torch.library.opcheck(R._fwd_lib, args)
    torch.library.opcheck(R._bwd_lib, (G, *args))
    f = torch.compile(lambda d: R.radial(d, ws, CUTOFF, 8), backend="aot_eager",
                      fullgraph=True)  # fmt: skip
    got = _run(lambda d, ws, *a: f(d), d, ws)
    ref = _run(_ref, d, ws)
    assert all(rel_err(a, b) < 1e-12 for a, b in zip(got, ref, strict=True))


def test_why_not_and_the_loud_fallback():
    book = [8, 64, 64, 448]
    assert R.why_not(DEV, torch.float32, book, "3xtf32") is None
    assert R.why_not(DEV, torch.float64, book) is None
    assert "float16" in R.why_not(DEV, torch.float16, book)
    assert "float64 takes" in R.why_not(DEV, torch.float64, book, "tf32")
    assert "bf16" in R.why_not(DEV, torch.float32, book, "bf16")
    assert "2 linear layers" in R.why_not(DEV, torch.float32, [8, 64, 448])
    assert "hidden" in R.why_not(DEV, torch.float32, [8, 129, 64, 448])
    assert "n_rbf" in R.why_not(DEV, torch.float32, [65, 64, 64, 448])
    # a depth the kernels do not run: the reference, announced
    d, ws = _lengths(9), _weights((8, 12, 7))
    with pytest.warns(FallbackWarning, match="radial"):
        got = R.radial(d, ws, CUTOFF, 8)
    assert torch.equal(got, _ref(d, ws, CUTOFF, 8))


def test_bad_inputs_raise_clear_errors():
    d, ws = _lengths(6), _weights()
    with pytest.raises(TypeError, match="floating"):
        R.radial(torch.arange(6, device=DEV), ws, CUTOFF, 8)
    with pytest.raises(TypeError, match="torch.Tensor"):
        R.radial([1.0, 2.0], ws, CUTOFF, 8)
    with pytest.raises(ValueError, match=r"shape \(E,\)"):
        R.radial(d[:, None], ws, CUTOFF, 8)
    with pytest.raises(TypeError, match="dtype"):
        R.radial(d.float(), ws, CUTOFF, 8)
    with pytest.raises(ValueError, match="is on"):
        R.radial(d, [(ws[0][0].to("meta"), ws[0][1]), *ws[1:]], CUTOFF, 8)
    with pytest.raises(ValueError, match=r"shape \(out, 7\)"):
        R.radial(d, ws, CUTOFF, 7)
    with pytest.raises(ValueError, match=r"weights\[1\]'s W"):
        R.radial(d, [ws[0], ws[0], ws[2]], CUTOFF, 8)
    with pytest.raises(ValueError, match=r"weights\[2\]'s b"):
        R.radial(d, [ws[0], ws[1], (ws[2][0], ws[1][1])], CUTOFF, 8)
    with pytest.raises(TypeError, match="pair"):
        R.radial(d, [ws[0][0]], CUTOFF, 8)
    with pytest.raises(ValueError, match="cutoff"):
        R.radial(d, ws, -1.0, 8)
    with pytest.raises(ValueError, match="n_rbf"):
        R.radial(d, ws, CUTOFF, 0)
    with pytest.raises(ValueError, match="precision"):
        R.radial(d, ws, CUTOFF, 8, "fp16")
    with pytest.raises(ValueError, match="float64 takes"):
        R.radial(d, ws, CUTOFF, 8, "tf32")


# ----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize(
    "precision, tol", [("fp32", 1e-6), ("3xtf32", 1e-6), ("tf32", 3e-3)]
)
def test_gpu_precisions_against_float64(precision, tol):
    """The chapter's widths on 20k edges: each precision's relative error against
    the float64 kernel (values and d's gradient) within its stated tolerance; fp32
    and 3xtf32 also pass the three-way rule."""
    cfg = ECEConfig()
    mlp = ECEModel(cfg).radial.to("cuda", torch.float64)
    ws64 = [(lin.weight, lin.bias) for lin in mlp[::2]]
    ws32 = [tuple(t.detach().float().requires_grad_() for t in p) for p in ws64]
    d64 = _lengths(20_000, hi=1.1 * cfg.cutoff)
    d32 = d64.detach().float().requires_grad_()
    truth = _run(R.radial, d64, ws64)
    got = _run(R.radial, d32, ws32, precision=precision)
    for a, t in zip(got, truth, strict=True):
        assert rel_err(a, t) < tol
    if precision != "tf32":
        ref32 = _run(_ref, d32, ws32)
        for a, b, t in zip(got, ref32, truth, strict=True):
            assert_close_three_way(a, b, t, f"radial {precision}")
