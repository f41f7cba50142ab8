"""EquivariantLinear (chapter 2): every path against the einsum reference, the plan,
and the contract at its boundary. The triton path runs in Triton's interpreter on CPU
machines and on the GPU elsewhere; the Gluon kernels' own tests are in
``test_linear_kernels.py``."""

import pytest
import torch

import ecekern
from ecekern import linear, options, reference
from ecekern._triton import INTERPRET, TensorDescriptor
from ecekern.linear import autograd, dense, plan, triton_modes
from ecekern.testing import assert_close_three_way, rel_err

G = lambda s: torch.Generator().manual_seed(s)
FAST = ["dense", "triton"]
DEV = "cpu" if INTERPRET else "cuda"


def _args(B, K, O, n_ang, dtype=torch.float64, seed=0, bias=True, lead=()):
    g = G(seed)
    xc = torch.randn(*lead, B, K, n_ang, generator=g, dtype=torch.float64).to(dtype)
    xs = torch.randn(*lead, B, K, n_ang, generator=g, dtype=torch.float64).to(dtype)
    w = torch.randn(n_ang, O, K, generator=g, dtype=torch.float64).to(dtype) / K**0.5
    b = torch.randn(O, generator=g, dtype=torch.float64).to(dtype) if bias else None
    return [
        t.to(DEV).requires_grad_() if t is not None else None for t in (xc, xs, w, b)
    ]


def _run(path, args, seed=1, fn=None):
    y = linear.equivariant_linear(*args, path=path) if fn is None else fn(*args)
    g = torch.Generator().manual_seed(seed)
    gy = [
        torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.device, t.dtype)
        for t in y
    ]
    wrt = [t for t in args if t is not None and t.requires_grad]
    return list(y) + list(torch.autograd.grad(y, wrt, gy))


def _matches_einsum(path, args, tol=1e-12):
    for got, ref in zip(_run(path, args), _run("einsum", args), strict=True):
        assert rel_err(got, ref) < tol


@pytest.mark.parametrize("path", FAST)
@pytest.mark.parametrize(
    "B, K, O, n_ang",
    [(37, 20, 35, 3), (16, 16, 16, 1), (5, 3, 17, 2), (33, 48, 9, 5), (9, 7, 5, 4)],
    ids=["awkward", "one-block", "tiny-in", "n_ang5", "n_ang4"],
)
def test_fp64_matches_einsum_with_all_gradients(path, B, K, O, n_ang):
    _matches_einsum(path, _args(B, K, O, n_ang))


@pytest.mark.parametrize("path", FAST)
def test_fp32_three_way_against_fp64(path):
    args64 = _args(40, 24, 30, 3)
    args32 = [t.detach().float().requires_grad_() for t in args64]
    ref64 = _run("einsum", args64)
    for got, ref32, truth in zip(
        _run(path, args32), _run("einsum", args32), ref64, strict=True
    ):
        assert_close_three_way(got, ref32, truth, path)


# --------------------------------------------------------------------------------------
# the stride contract: any strides for x, W and the bias
# --------------------------------------------------------------------------------------
def _strided(t, how):
    """``t``'s values in a tensor of other strides: every other element of a larger
    tensor ("sliced"), or the transpose of a contiguous one ("transposed")."""
    if how == "sliced":
        big = torch.zeros(
            *t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device
        )
        big[..., ::2] = t.detach()
        return big[..., ::2].requires_grad_()
    return t.detach().transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_()


@pytest.mark.parametrize("path", FAST)
@pytest.mark.parametrize(
    "which", ["x_m_major", "x_sliced", "weight", "bias", "batched"]
)
def test_strided_inputs_match_einsum(path, which):
    """x m-major or a slice, W transposed storage, a bias that is every other element
    of a larger tensor, leading batch dims. The strided bias was read as contiguous by
    the Triton kernel (and both Gluon kernels): off by 2.6 before the contract."""
    lead = (2,) if which == "batched" else ()
    xc, xs, w, b = _args(19, 18, 21, 3, lead=lead)
    if which == "x_m_major":
        xc, xs = _strided(xc, "transposed"), _strided(xs, "transposed")
        assert xc.stride(-1) != 1
    elif which == "x_sliced":
        xc, xs = _strided(xc, "sliced"), _strided(xs, "sliced")
    elif which == "weight":
        w = _strided(w, "transposed")
    elif which == "bias":
        b = _strided(b, "sliced")
        assert b.stride(0) == 2
    _matches_einsum(path, [xc, xs, w, b])


@pytest.mark.parametrize("path", FAST)
def test_empty_rows_no_bias_and_no_inputs(path):
    for B, K, bias in ((0, 5, True), (6, 5, False), (4, 0, True)):
        args = _args(B, K, 7, 3, bias=bias)
        y = linear.equivariant_linear(*args, path=path)
        ref = reference.equivariant_linear(*args)
        for got, r in zip(y, ref, strict=True):
            assert got.shape == r.shape and rel_err(got, r) < 1e-12


def test_frozen_weights_compute_only_input_gradients():
    xc, xs, w, b = _args(21, 17, 19, 3)
    w.requires_grad_(False)
    b.requires_grad_(False)
    y = linear.equivariant_linear(xc, xs, w, b, "triton")
    (y[0].sum() + y[1].sum()).backward()
    assert w.grad is None and b.grad is None
    assert xc.grad is not None and xs.grad is not None


@pytest.mark.parametrize("leaf", [True, False], ids=["parameter", "derived"])
@pytest.mark.parametrize("which", [2, 3], ids=["weight", "bias"])
def test_parameter_gradient_only_when_the_backward_asks_for_it(
    which, leaf, monkeypatch
):
    """Forces are ``torch.autograd.grad(energy, positions)``: the weight and the bias
    require grad but nobody asks for theirs, and neither the weight-gradient GEMM nor
    the bias's sum may run; ``.backward()`` and a ``grad`` that names the parameter
    still get it, exactly."""
    calls = []
    real_w = autograd.bwd_w_gemm
    monkeypatch.setattr(
        autograd, "bwd_w_gemm", lambda *a: calls.append("w") or real_w(*a)
    )
    args = _args(23, 17, 19, 3)
    p0 = args[which]
    name = "w" if which == 2 else "b"

    def energy(path="triton"):
        a = list(args)
        a[which] = p0 if leaf else p0 * 1.0  # built from a parameter: not a leaf
        y = linear.equivariant_linear(*a, path)
        return (y[0] ** 2).sum() + (y[1] ** 2).sum()

    (dx,) = torch.autograd.grad(energy(), [args[0]])
    assert calls == [] and dx is not None
    dx2, dp = torch.autograd.grad(energy(), [args[0], p0])
    assert torch.equal(dx, dx2) and calls == (["w"] if name == "w" else [])
    (dp_ref,) = torch.autograd.grad(energy("einsum"), [p0])
    assert rel_err(dp, dp_ref) < 1e-12


@pytest.mark.parametrize("n_ang", [1, 3, 5])
def test_weight_gradient_gemm_is_the_block_diagonal(n_ang):
    g = G(n_ang)
    gc, gs = (torch.randn(13, 7, n_ang, generator=g, dtype=torch.float64) for _ in "cs")
    xc, xs = (torch.randn(13, 5, n_ang, generator=g, dtype=torch.float64) for _ in "cs")
    want = torch.einsum("bom,bkm->mok", gc, xc) + torch.einsum("bom,bkm->mok", gs, xs)
    assert rel_err(dense.bwd_w_gemm(gc, gs, xc, xs), want) < 1e-14


def test_transposed_weight_is_copied_once_until_the_weight_changes():
    w = torch.randn(3, 6, 5, dtype=torch.float64)
    first = autograd.w_t_copy(w)
    assert torch.equal(first, w.transpose(1, 2)) and first.is_contiguous()
    assert autograd.w_t_copy(w) is first
    w.mul_(2.0)  # in place: the version counter moves
    second = autograd.w_t_copy(w)
    assert second is not first and torch.equal(second, w.transpose(1, 2))
    key = id(w)
    assert key in autograd._W_T
    del w, first, second
    assert key not in autograd._W_T


def test_deterministic():
    args = _args(50, 24, 16, 3)
    first = _run("triton", args)
    for a, b in zip(first, _run("triton", args), strict=True):
        assert torch.equal(a, b)


def test_gradcheck_and_gradgradcheck_of_the_triton_path():
    # small, and fast_mode: every evaluation is a kernel launch in the interpreter
    args = _args(3, 2, 2, 2)
    f = lambda *a: linear.equivariant_linear(*a, path="triton")
    assert torch.autograd.gradcheck(f, args)
    assert torch.autograd.gradgradcheck(f, args, fast_mode=True)


def test_state_dict_loads_across_paths():
    a = ecekern.EquivariantLinear(12, 7, 3, path="einsum").to(DEV, torch.float64)
    b = ecekern.EquivariantLinear(12, 7, 3, path="triton").to(DEV, torch.float64)
    c = ecekern.EquivariantLinear(12, 7, 3, path="dense").to(DEV, torch.float64)
    b.load_state_dict(a.state_dict())
    c.load_state_dict(b.state_dict())
    x = _args(10, 12, 7, 3)[:2]
    for m in (b, c):
        for got, ref in zip(m(*x), a(*x), strict=True):
            assert rel_err(got, ref) < 1e-12


@pytest.mark.parametrize("path", FAST)
def test_bad_inputs_are_rejected_like_the_reference(path):
    xc, xs, w, b = _args(4, 5, 6, 3)
    with pytest.raises(ValueError):
        linear.equivariant_linear(xc, xs[..., :2], w, b, path)
    with pytest.raises(ValueError):
        linear.equivariant_linear(xc, xs, w[:, :, :4], b, path)
    with pytest.raises(TypeError):
        linear.equivariant_linear(xc.float(), xs.float(), w, b, path)
    with pytest.raises(ValueError):
        linear.equivariant_linear(xc, xs, w, b[:3], path)
    with pytest.raises(ValueError, match="path must be one of"):
        linear.equivariant_linear(xc, xs, w, b, path="fast")


# --------------------------------------------------------------------------------------
# the plan: resolved once per (device, dtype, TF32, shape, layout), cached
# --------------------------------------------------------------------------------------
def test_dispatch_follows_the_path_argument(monkeypatch):
    """The op takes its path as an argument; the options do not reach it (the step
    plan hands the model's linears theirs)."""
    xc, xs, w, b = _args(4, 5, 6, 2)
    calls = []
    apply = autograd.EquivariantLinearFn.apply
    monkeypatch.setattr(
        autograd.EquivariantLinearFn,
        "apply",
        lambda *a: calls.append(1) or apply(*a),
    )
    linear.equivariant_linear(xc, xs, w, b)
    assert calls == []  # n_ang = 2: einsum or dense
    linear.equivariant_linear(xc, xs, w, b, path="triton")
    assert calls == [1]
    with options.use(reference=True, linear="triton"):  # ops read no options
        linear.equivariant_linear(xc, xs, w, b, path="dense")
        assert calls == [1]
        y = linear.equivariant_linear(xc, xs, w, b, path="einsum")
        assert calls == [1]
    ref = reference.equivariant_linear(xc, xs, w, b)
    assert torch.equal(y[0], ref[0])


def test_plan_is_cached_and_the_auto_table():
    """``auto`` on CUDA: the Gluon FMA kernel in strict fp32 at n_ang = 3 (the einsum
    where it cannot serve), the tensor-core kernel in bf16 at n_ang = 3 where it
    serves the shape and the operands (else the dense GEMM), the dense GEMM on the
    tensor cores up to n_ang = 5, the einsum elsewhere; the einsum on the CPU."""
    f32, bf16 = torch.float32, torch.bfloat16
    gluon = plan.GLUON_REASON is None

    def p(dtype, tf32, n_ang, K=192, O=192, rows=True, tc=True, dev="cuda"):
        return plan.path_for("auto", plan.Key(dev, dtype, tf32, n_ang, K, O, rows, tc))

    assert p(f32, False, 3) is p(f32, False, 3)  # cached: the same object
    assert p(f32, False, 3, dev="cpu") == plan.Plan("einsum")
    assert p(f32, False, 3).kernel == ("fma" if gluon else "")
    assert p(f32, False, 3, rows=False).path == "einsum"
    assert p(f32, False, 3, rows=False).note
    assert p(f32, True, 3) == plan.Plan("dense")
    assert p(f32, True, 6) == plan.Plan("einsum")
    assert p(f32, False, 2) == plan.Plan("einsum")
    assert p(bf16, False, 3).path == ("triton" if gluon else "dense")
    assert p(bf16, False, 3, tc=False).path == "dense"
    assert p(bf16, False, 3, K=100).path == "dense"  # not a multiple of 64
    assert p(bf16, False, 5) == plan.Plan("dense")
    assert p(torch.float64, False, 3) == plan.Plan("einsum")


def test_triton_path_that_cannot_serve_falls_back_loudly():
    options.reset_fallback_warnings()
    args = _args(4, 5, 6, triton_modes.MAX_N_ANG + 1)
    with pytest.warns(options.FallbackWarning, match="n_ang"):
        _matches_einsum("triton", args)


def test_a_slower_kernel_says_so_once():
    """Where the Gluon FMA kernel cannot take x (rows not contiguous), the strict-fp32
    plan names the Triton kernel it hands the call to; the warning comes once."""
    got = plan.kernel_for(plan.Key("cuda", torch.float32, False, 3, 8, 8, False, True))
    assert got.kernel == "triton" and "FMA" in got.note
    options.reset_fallback_warnings()
    with pytest.warns(options.SlowerKernelWarning, match="slower kernel"):
        options.slower("equivariant_linear", got.note)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        options.slower("equivariant_linear", got.note)  # said once only


@pytest.mark.parametrize("bias", [True, False])
def test_dense_path_copies_nothing_and_has_no_bmm(bias):
    """The layout churn this chapter removes: forward and backward of the dense path
    issue no ``aten::copy_``, ``clone`` or ``bmm`` (the einsum issues all three). On
    the CPU ``addmm`` itself copies the bias into its output before the GEMM."""
    from torch.profiler import profile

    xc, xs, w, b = (
        t.detach().cpu().requires_grad_() if t is not None else None
        for t in _args(20, 7, 5, 3, torch.float32, bias=bias)
    )
    counts = {}
    for path in ("einsum", "dense"):
        y = linear.equivariant_linear(xc, xs, w, b, path=path)  # warm
        gy = [torch.randn_like(t) for t in y]
        with profile() as prof:
            y = linear.equivariant_linear(xc, xs, w, b, path=path)
            torch.autograd.backward(y, gy)
        names = [
            e.name
            for e in prof.events()
            if not (e.cpu_parent is not None and e.cpu_parent.name == "aten::addmm")
        ]
        counts[path] = {
            n: names.count(f"aten::{n}") for n in ("copy_", "clone", "bmm", "mm")
        }
    assert counts["einsum"]["bmm"] > 0 and counts["einsum"]["copy_"] > 0
    assert counts["dense"]["copy_"] == counts["dense"]["clone"] == 0
    assert counts["dense"]["bmm"] == 0 and counts["dense"]["mm"] > 0


@pytest.mark.parametrize(
    "launch",
    [
        triton_modes.TritonLaunch(),
        triton_modes.TritonLaunch(prefetch=True, w_desc=True),
        triton_modes.TritonLaunch(prefetch=True, store3=True, join=True),
    ],
    ids=["plain", "prefetch-desc", "prefetch-join"],
)
@pytest.mark.parametrize("n_ang", [1, 2, 3, 5])
def test_launch_switches_match_einsum(launch, n_ang):
    """Every launch switch of the Triton kernel, given as an argument (no module state
    changes): forward and input backward (W transposed) against the einsum."""
    xc, _, w, b = (t.detach() for t in _args(37, 20, 35, n_ang))
    got = triton_modes.triton_fwd(xc, w, b, launch)
    want = reference.equivariant_linear(xc, xc, w, b)[0]
    assert rel_err(got, want) < 1e-12
    g = torch.randn(37, 35, n_ang, dtype=torch.float64, device=DEV)
    dx = triton_modes.triton_fwd(g, w.transpose(1, 2), None, launch)
    assert rel_err(dx, torch.einsum("bom,mok->bkm", g, w)) < 1e-12


@pytest.mark.parametrize("path", FAST)
def test_model_energy_and_forces_with_each_path(path):
    cfg = ecekern.ECEConfig(channels=3, radial_hidden=8, readout_hidden=4, n_gated=1)
    model = ecekern.ECEModel(cfg).double()
    atoms = ecekern.systems.diamond(1, rattle=0.1, seed=4)[:4]
    atoms.pbc = False
    with options.use(reference=True):
        e_ref, f_ref = ecekern.energy_and_forces(model, atoms)
    model.to(DEV)
    with options.use(linear=path, stack="linears"):
        assert model.plan().linear == path
        e, f = ecekern.energy_and_forces(model, atoms)
    assert rel_err(e, e_ref) < 1e-12 and rel_err(f, f_ref) < 1e-10


@pytest.mark.skipif(TensorDescriptor is None or INTERPRET, reason="no descriptors")
def test_w_descriptor_only_where_the_copy_engine_can_serve():
    w = torch.randn(3, 64, 64, device=DEV)
    assert triton_modes._w_descriptor(w, 64, 32, True)[2] == 1
    assert triton_modes._w_descriptor(w.transpose(1, 2), 64, 32, True)[2] == 2
    assert triton_modes._w_descriptor(w.transpose(1, 2), 64, 32, False)[2] == 1
    odd = torch.randn(3 * 63 * 63 + 1, device=DEV)[1:].view(3, 63, 63)
    assert triton_modes._w_descriptor(odd, 64, 32, True)[2] == 0


# --------------------------------------------------------------------------------------
# GPU: precisions with their stated tolerances (fp64 truth from the reference)
# --------------------------------------------------------------------------------------
PRECISIONS = [
    (torch.float64, False, 1e-12),
    (torch.float32, False, 1e-5),
    (torch.float32, True, 3e-3),
    (torch.bfloat16, False, 3e-2),
    (torch.float16, False, 5e-3),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tf32, tol", PRECISIONS)
@pytest.mark.parametrize("path", ["auto", *FAST])
@pytest.mark.parametrize("n_ang", [3, 5])
def test_gpu_precisions(path, dtype, tf32, tol, n_ang):
    from ecekern.bench import set_tf32

    before = torch.backends.cuda.matmul.allow_tf32
    try:
        set_tf32(tf32)
        args64 = _args(4099, 192, 192, n_ang)
        args = [t.detach().to(dtype).requires_grad_() for t in args64]
        truth = _run("einsum", args64)
        for got, ref in zip(_run(path, args), truth, strict=True):
            assert got.dtype == dtype and rel_err(got, ref) < tol
    finally:
        set_tf32(before)


@pytest.mark.gpu
@pytest.mark.parametrize("tf32", [False, True], ids=["fp32", "tf32"])
def test_gpu_force_steps_copy_no_weight_after_the_first(tf32):
    """The layer's weight layouts are made once (``autograd.w_t_copy``): a second
    force-like step runs no ``aten::copy_``; after an in-place weight update the next
    step makes one fresh copy and the results follow the new weight."""
    from ecekern.bench import set_tf32

    x_c, x_s, w = (t.detach().float() for t in _args(600, 192, 192, 3)[:3])
    for t in (x_c, x_s, w):
        t.requires_grad_()

    def step():
        y_c, y_s = linear.equivariant_linear(x_c, x_s, w, None, path="triton")
        e = (y_c * y_c).sum() + (y_s * y_s).sum()
        return torch.autograd.grad(e, (x_c, x_s))

    def copies():
        with torch.profiler.profile() as prof:
            out = step()
            torch.cuda.synchronize()
        return out, sum(e.name == "aten::copy_" for e in prof.events())

    before = torch.backends.cuda.matmul.allow_tf32
    set_tf32(tf32)
    try:
        step()
        (g_c, g_s), n = copies()
        assert n == 0
        with torch.no_grad():
            w.mul_(0.5)
        (h_c, h_s), n = copies()
        assert n == 1  # the one fresh W^T
    finally:
        set_tf32(before)
    tol = 3e-3 if tf32 else 1e-5
    assert rel_err(h_c.double(), 0.25 * g_c.double()) < tol  # dx scales as W^2
    assert rel_err(h_s.double(), 0.25 * g_s.double()) < tol


def test_the_input_backward_plan_looks_at_the_gradient_layout():
    """An expanded or permuted gradient (``.sum().backward()`` hands an expanded one)
    must not reach the tensor-core kernel, whose TMA needs it contiguous."""
    g = torch.ones(1, 1, 1).expand(64, 192, 3)
    assert autograd.layout(g, None) == (False, False)
    assert autograd.layout(torch.randn(64, 192, 3), None) == (True, True)
    key = plan.Key(
        "cuda", torch.bfloat16, False, 3, 192, 192, *autograd.layout(g, None)
    )
    assert plan.kernel_for(key).kernel != "tc"


def test_the_kept_transposed_weight_skips_inference_tensors():
    with torch.inference_mode():
        w = torch.randn(3, 6, 5)
    assert torch.equal(autograd.w_t_copy(w), w.transpose(1, 2))
    assert id(w) not in autograd._W_T


# --------------------------------------------------------------------------------------
# the torch.library op and torch.compile
# --------------------------------------------------------------------------------------
def test_the_kernel_op_passes_opcheck():
    """``ecekern::linear_kernel`` (opaque everywhere): schema, fake implementation
    and AOT dispatch, forward and transposed (the input backward), with and without
    a bias."""
    xc, _, w, b = (t.detach() for t in _args(5, 4, 6, 3))
    g = torch.randn(5, 6, 3, dtype=xc.dtype, device=xc.device)
    torch.library.opcheck(autograd._kernel_op, (xc, w, b, False, False))
    torch.library.opcheck(autograd._kernel_op, (xc, w, None, False, False))
    torch.library.opcheck(autograd._kernel_op, (g, w, None, False, True))


def _compiled_vs_eager(backend, dtype, tol, B, K, O, n_ang):
    """The triton path compiled with ``backend``, fullgraph, against eager: y and the
    first derivatives of x, W and the bias."""
    args = [t.detach().to(dtype).requires_grad_() for t in _args(B, K, O, n_ang)]
    f = lambda *a: linear.equivariant_linear(*a, path="triton")
    torch._dynamo.reset()
    try:
        got = _run(None, args, fn=torch.compile(f, backend=backend, fullgraph=True))
    finally:
        torch._dynamo.reset()
    want = _run(None, args, fn=f)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == dtype and rel_err(a, b) < tol, (i, rel_err(a, b))


def test_compiled_matches_eager_through_the_op():
    """Traced by Dynamo and AOT autograd (``aot_eager``: the op is a leaf of the
    graph, run by the interpreter here), fullgraph: the same numbers."""
    _compiled_vs_eager("aot_eager", torch.float64, 1e-13, 7, 5, 6, 3)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype, tol",
    [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 1e-2)],
    ids=["fp64-triton", "fp32-gluon-fma", "bf16-gluon-tc"],
)
def test_gpu_inductor_compile_matches_eager(dtype, tol):
    """``torch.compile`` with inductor, fullgraph: the op stays opaque (inductor
    generates no code for the Gluon kernels), values and first derivatives as in
    eager, at a shape each kernel serves (B, K, O = 600, 192, 192, n_ang = 3)."""
    _compiled_vs_eager("inductor", dtype, tol, 600, 192, 192, 3)
