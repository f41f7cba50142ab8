"""The Gluon kernels of the linear: the tensor-core kernel's 0/1 mode-split matrices,
which calls each kernel serves, their results against float64 on the GPU (Gluon does
not run in Triton's CPU interpreter), the plan choosing them, and ``torch.compile``."""

import pytest
import torch

import ecekern
from ecekern import bench, linear, options, reference
from ecekern._triton import INTERPRET
from ecekern.linear import autograd, gluon_fma, gluon_tc, plan
from ecekern.testing import linear_args, rel_err

CUDA = torch.cuda.is_available() and not INTERPRET


@pytest.mark.parametrize("G", [16, 8], ids=["bf16", "tf32"])
def test_mode_split_matrices_take_the_modes_apart_exactly(G):
    """One group of G inputs, 3 G interleaved columns, times P: mode m's G inputs in
    columns G m .. G m + G - 1, zeros after column 3 G - 1, each value exactly once.
    In TF32 in the order of a ``wgmma`` A operand's registers: A column t + 4 b is
    accumulator column 2 t + b."""
    order = list(range(16)) if G == 16 else [2 * (c % 4) + c // 4 for c in range(8)]
    for dtype in (torch.float64, torch.bfloat16 if G == 16 else torch.float32):
        s = gluon_tc.mode_split_matrices(dtype, G=G)
        assert s.shape == (3, 4 * G, G) and s.dtype == dtype
        p = torch.cat([s[j].t() for j in range(3)])  # (3 G, 4 G): rows G j + c
        assert torch.equal(p.sum(1), torch.ones(3 * G, dtype=dtype))
        x = torch.randn(7, G, 3, dtype=torch.float64).to(dtype)  # (rows, f, m)
        got = x.reshape(7, 3 * G) @ p
        for m in range(3):
            assert torch.equal(got[:, G * m : G * m + G][:, order], x[:, :, m])
        assert not got[:, 3 * G :].any()


@pytest.mark.parametrize(
    "dtype, n_ang, K, O, reason",
    [
        (torch.float16, 3, 64, 64, "bf16 and fp32"),
        (torch.bfloat16, 2, 64, 64, "n_ang = 2"),
        (torch.bfloat16, 3, 48, 64, "multiple of 64"),
        (torch.bfloat16, 3, 64, 32, "O of 64"),
        (torch.bfloat16, 3, 320, 64, "shared memory"),
        (torch.float32, 3, 256, 64, "K = 256 > 192"),
    ],
)
def test_tc_shape_reason_names_what_it_cannot_serve(dtype, n_ang, K, O, reason):
    got = gluon_tc.shape_reason(dtype, n_ang, K, O, "cuda")
    if gluon_tc.gluon is None:
        assert "Gluon" in got
    else:
        assert reason in got
        assert gluon_tc.shape_reason(torch.bfloat16, 3, 192, 192, "cuda") is None


def test_tc_operand_reason():
    x, w, _ = linear_args(64, 64, 64, 3, torch.bfloat16)
    assert gluon_tc.operand_reason(x, w) is None
    assert "contiguous" in gluon_tc.operand_reason(
        x.transpose(0, 1).contiguous().transpose(0, 1), w
    )
    assert "aligned" in gluon_tc.operand_reason(
        torch.cat([x.flatten(), x.flatten()])[1 : 1 + x.numel()].view_as(x), w
    )
    assert "dtype" in gluon_tc.operand_reason(x, w.float())


def test_fma_reason_names_what_it_cannot_serve():
    x, w, _ = linear_args(8, 16, 16, 3, torch.float32)
    if gluon_fma.gluon is None:
        assert "Gluon" in gluon_fma.fma_reason(x, w, False)
        return
    assert "CUDA" in gluon_fma.fma_reason(x, w, False)
    assert "TF32" in gluon_fma.fma_reason(x, w, True)
    assert "fp32 only" in gluon_fma.fma_reason(x.double(), w.double(), False)


# --------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------
SIZES = [(4099, 192, 192), (300, 48, 20), (1, 16, 64), (129, 100, 70)]


def _truth(x, w, b):
    return reference.equivariant_linear(
        x.double(), x.double(), w.double(), b.double() if b is not None else None
    )[0]


@pytest.mark.gpu
@pytest.mark.parametrize("tile", list(gluon_fma.TILES))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("B, K, O", SIZES)
def test_gpu_fma_forward_and_input_backward_match_float64(B, K, O, bias, tile):
    if not CUDA:
        pytest.skip("needs a CUDA device")
    bench.set_tf32(False)
    x, w, b = linear_args(B, K, O, 3, torch.float32, "cuda")
    b = b if bias else None
    assert gluon_fma.fma_reason(x, w, False) is None
    w_o = w.transpose(1, 2).contiguous().transpose(1, 2)  # O contiguous
    y = gluon_fma.fma_fwd(x, w_o, b, gluon_fma.FmaLaunch(tile=tile))
    assert rel_err(y, _truth(x, w, b)) < 1e-6
    g = torch.randn(B, O, 3, device="cuda")
    dx = gluon_fma.fma_fwd(g, w.transpose(1, 2), None, gluon_fma.FmaLaunch(tile=tile))
    assert rel_err(dx, torch.einsum("bom,moi->bim", g.double(), w.double())) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize(
    "tf32, B, K, O",
    [(False, 4099, 192, 192), (False, 300, 64, 64), (False, 77, 256, 128),
     (True, 4099, 192, 192), (True, 300, 64, 64)],  # TF32 takes K <= 192
    ids=["bf16-192", "bf16-64", "bf16-256x128", "tf32-192", "tf32-64"],
)  # fmt: skip
def test_gpu_tc_forward_matches_float64(B, K, O, tf32):
    if not CUDA:
        pytest.skip("needs a CUDA device")
    if gluon_tc.gluon is None:
        pytest.skip("no validated Gluon in this Triton")
    dtype = torch.float32 if tf32 else torch.bfloat16
    assert gluon_tc.shape_reason(dtype, 3, K, O, "cuda") is None
    x, w, b = linear_args(B, K, O, 3, dtype, "cuda")
    y = gluon_tc.tc_fwd(x, w, b)
    err = rel_err(y.double(), _truth(x, w, b))
    assert err < 4e-3 if dtype == torch.bfloat16 else 1e-5 < err < 2e-3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_auto_runs_the_gluon_kernels_both_ways(dtype, monkeypatch):
    """``auto`` at the model's width: strict fp32 through the FMA kernel, bf16 through
    the tensor-core kernel, forward (cos and sin) and input backward (cos and sin),
    all gradients against float64; an m-major x has its forward from another path,
    and says so once."""
    if not CUDA:
        pytest.skip("needs a CUDA device")
    bench.set_tf32(False)
    name = "fma_fwd" if dtype == torch.float32 else "tc_fwd"
    calls = []
    real = getattr(autograd, name)
    monkeypatch.setattr(
        autograd, name, lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    x_c, w, b = linear_args(4099, 192, 192, 3, dtype, "cuda")
    x_s = linear_args(4099, 192, 192, 3, dtype, "cuda", seed=1)[0]
    args = [t.clone().requires_grad_() for t in (x_c, x_s, w, b)]
    y = linear.equivariant_linear(*args)
    gy = [torch.randn_like(t) for t in y]
    grads = torch.autograd.grad(y, args[:2], gy)
    assert len(calls) == 4
    a64 = [t.detach().double().requires_grad_() for t in args]
    y64 = reference.equivariant_linear(*a64)
    g64 = torch.autograd.grad(y64, a64[:2], [t.double() for t in gy])
    tol = 1e-5 if dtype == torch.float32 else 1.5e-2
    for got, ref in zip([*y, *grads], [*y64, *g64], strict=True):
        assert rel_err(got, ref) < tol
    m_major = [t.permute(2, 0, 1).contiguous().permute(1, 2, 0) for t in args[:2]]
    p = linear.plan_of(m_major[0], w)
    assert p.kernel != ("fma" if dtype == torch.float32 else "tc") and p.note
    options.reset_fallback_warnings()
    with pytest.warns(options.SlowerKernelWarning):
        y2 = linear.equivariant_linear(*m_major, w, b)
    assert rel_err(y2[0], y64[0]) < tol


@pytest.mark.gpu
# --------------------------------------------------------------------------------------
# torch.compile: the kernels are one opaque op, never code that inductor generates
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype, tf32, path, tol",
    [
        (torch.float32, False, "auto", 1e-5),  # the Gluon FMA kernel
        (torch.float32, True, "auto", 5e-3),  # the dense GEMM (inductor's own, TF32)
        (torch.float32, True, "triton", 1e-5),  # the Triton kernel (TF32)
        (torch.bfloat16, False, "auto", 1e-2),  # the Gluon tensor-core kernel
        (torch.float64, False, "triton", 1e-12),  # the Triton kernel (fp64)
    ],
)
def test_gpu_compiled_equals_eager_for_every_linear_path(dtype, tf32, path, tol):
    if not CUDA:
        pytest.skip("needs a CUDA device")
    torch._dynamo.reset()
    bench.set_tf32(tf32)
    try:
        lin = ecekern.EquivariantLinear(192, 192, 3, path=path).to("cuda", dtype)
        x = [
            torch.randn(999, 192, 3, device="cuda", dtype=dtype, requires_grad=True)
            for _ in range(2)
        ]

        acc = torch.float64 if dtype == torch.float64 else torch.float32

        def f(xc, xs):  # the energy summed in float64 when the inputs are float64
            y_c, y_s = lin(xc, xs)
            e = (y_c.to(acc) ** 2).sum() + y_s.to(acc).sum()
            return e, torch.autograd.grad(e, (xc, xs))

        e0, g0 = f(*x)
        e1, g1 = torch.compile(f)(*x)
        assert rel_err(e1, e0) < tol
        for a, b in zip(g1, g0, strict=True):
            assert rel_err(a, b) < tol
    finally:
        bench.set_tf32(False)


@pytest.mark.gpu
@pytest.mark.parametrize("n_atoms", [64, 512])
def test_gpu_compiled_force_step_equals_eager_with_default_options(n_atoms):
    """``torch.compile(model)`` with the library's defaults gives the eager energy
    and forces by the three-way rule against float64: strict fp32 and TF32 (where
    inductor's own GEMMs round differently from eager's). The compiled step runs the
    mixing stack as its linears, and says so once."""
    if not CUDA:
        pytest.skip("needs a CUDA device")
    from ecekern.model import force_step, prepare_inputs

    atoms = ecekern.systems.diamond({64: 2, 512: 4}[n_atoms])
    model = ecekern.ECEModel().to("cuda", torch.float64)
    truth = force_step(model, *prepare_inputs(atoms, 5.0, torch.float64, "cuda"))
    model = model.float()
    inputs = prepare_inputs(atoms, 5.0, torch.float32, "cuda")
    for tf32, atol in ((False, 1e-5), (True, 5e-3)):
        torch._dynamo.reset()
        bench.set_tf32(tf32)
        try:
            eager = force_step(model, *inputs)
            options.reset_fallback_warnings()
            with pytest.warns(options.FallbackWarning, match="torch.compile"):
                compiled = force_step(torch.compile(model), *inputs)
        finally:
            bench.set_tf32(False)
        for got, ref, t in zip(compiled, eager, truth, strict=True):
            assert rel_err(got, t) <= 2 * rel_err(ref, t) + atol, (tf32, got, ref)


def test_plan_choices_are_plain_values():
    """The plan is a pure function of plain values: the same key, the same object."""
    key = plan.Key("cuda", torch.bfloat16, False, 3, 192, 192, True, True)
    assert plan.kernel_for(key) is plan.kernel_for(key)


def test_gluon_only_on_the_validated_triton_release():
    """The Gluon kernels use Triton internals: another release runs the Triton
    kernels, and the reason says which release was validated."""
    from ecekern import _triton

    if not _triton.AVAILABLE:
        pytest.skip("no Triton")
    release = ".".join(_triton.triton.__version__.split(".")[:2])
    if release not in _triton.GLUON_VALIDATED:
        assert _triton.gluon is None and "validated on" in _triton.GLUON_REASON
        key = plan.Key("cuda", torch.float32, False, 3, 192, 192, True, True)
        assert plan.kernel_for(key).kernel == "triton"
    elif INTERPRET:
        assert _triton.gluon is None and "interpreter" in _triton.GLUON_REASON
    else:
        assert _triton.gluon is not None and _triton.GLUON_REASON is None


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's variant of the GPU tests")
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_triton_path_equals_eager_in_the_interpreter(backend):
    """The kernels run inside the opaque ``ecekern::linear_kernel`` op while
    compiling: dynamo and AOTAutograd trace the Function around it, forward and
    input backward, in fp64 to the last bit."""
    torch._dynamo.reset()
    lin = ecekern.EquivariantLinear(16, 16, 3, path="triton").double()
    g = torch.Generator().manual_seed(0)
    x = [
        torch.randn(33, 16, 3, generator=g, dtype=torch.float64, requires_grad=True)
        for _ in range(2)
    ]

    def f(xc, xs):
        y_c, y_s = lin(xc, xs)
        e = (y_c**2).sum() + y_s.sum()
        return e, torch.autograd.grad(e, (xc, xs))

    e0, g0 = f(*x)
    e1, g1 = torch.compile(f, backend=backend)(*x)
    assert rel_err(e1, e0) < 1e-14
    for a, b in zip(g1, g0, strict=True):
        assert rel_err(a, b) < 1e-14


@pytest.mark.slow
@pytest.mark.skipif(not INTERPRET, reason="the interpreter's variant of the GPU tests")
def test_compiled_model_with_the_fast_paths_equals_eager_in_the_interpreter():
    """``torch.compile(model)`` (inductor) with the triton linear and the fused zonal
    scatter, as the defaults take them on CUDA: the eager energy and forces."""
    from ecekern.model import force_step, prepare_inputs

    torch._dynamo.reset()
    cfg = ecekern.ECEConfig(channels=4, radial_hidden=8, readout_hidden=4, n_gated=1)
    atoms = ecekern.systems.diamond(1, rattle=0.1, seed=3)
    model = ecekern.ECEModel(cfg).double()
    inputs = prepare_inputs(atoms, cfg.cutoff)
    with options.use(linear="triton", zonal="fused"):
        e0, f0 = force_step(model, *inputs)
        e1, f1 = force_step(torch.compile(model), *inputs)
    assert rel_err(e1, e0) < 1e-13 and rel_err(f1, f0) < 1e-12
