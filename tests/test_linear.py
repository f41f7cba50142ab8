import pytest
import torch

import ecekern
from ecekern import linear, linear_fma, linear_tc, options, reference
from ecekern.testing import assert_close_three_way, rel_err

G = lambda s: torch.Generator().manual_seed(s)
FAST = ["dense", "triton"]
# the Triton path runs in the interpreter on CPU machines and on the GPU elsewhere
DEV = "cpu" if linear.INTERPRET else "cuda"


def _served(path, dtype, n_ang):
    """Whether the fast path serves this call here (CUDA has a validated list)."""
    if path != "triton" or DEV == "cpu":
        return True
    return n_ang <= linear.CUDA_VALIDATED.get(dtype, 0)


def _args(B, K, O, n_ang, dtype=torch.float64, seed=0, bias=True, lead=()):
    g = G(seed)
    xc = torch.randn(*lead, B, K, n_ang, generator=g, dtype=torch.float64).to(dtype)
    xs = torch.randn(*lead, B, K, n_ang, generator=g, dtype=torch.float64).to(dtype)
    w = torch.randn(n_ang, O, K, generator=g, dtype=torch.float64).to(dtype) / K**0.5
    b = torch.randn(O, generator=g, dtype=torch.float64).to(dtype) if bias else None
    return [
        t.to(DEV).requires_grad_() if t is not None else None for t in (xc, xs, w, b)
    ]


def _run(path, args, seed=1):
    y = linear.equivariant_linear(*args, path=path)
    g = torch.Generator().manual_seed(seed)
    gy = [
        torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.device, t.dtype)
        for t in y
    ]
    wrt = [t for t in args if t is not None and t.requires_grad]
    grads = torch.autograd.grad(y, wrt, gy)
    return list(y) + list(grads)


@pytest.mark.parametrize("path", FAST)
@pytest.mark.parametrize(
    "B, K, O, n_ang",
    [(37, 20, 35, 3), (16, 16, 16, 1), (5, 3, 17, 2), (33, 48, 9, 5)],
    ids=["awkward", "one-block", "tiny-in", "n_ang5"],
)
def test_fp64_matches_einsum_with_all_gradients(path, B, K, O, n_ang):
    if not _served(path, torch.float64, n_ang):
        pytest.skip("not validated on CUDA: not validated on CUDA")
    args = _args(B, K, O, n_ang)
    for got, ref in zip(_run(path, args), _run("einsum", args), strict=True):
        assert rel_err(got, ref) < 1e-12


@pytest.mark.parametrize("path", FAST)
def test_fp32_three_way_against_fp64(path):
    if not _served(path, torch.float32, 3):
        pytest.skip("not validated on CUDA: not validated on CUDA")
    args64 = _args(40, 24, 30, 3)
    args32 = [t.detach().float().requires_grad_() for t in args64]
    ref64 = _run("einsum", args64)
    for got, ref32, truth in zip(
        _run(path, args32), _run("einsum", args32), ref64, strict=True
    ):
        assert_close_three_way(got, ref32, truth, path)


@pytest.mark.parametrize("path", FAST)
def test_non_contiguous_m_major_and_batched_inputs(path):
    g = G(3)
    B, K, O, n_ang = 19, 18, 21, 3
    xc = torch.randn(B, n_ang, K, generator=g, dtype=torch.float64).transpose(1, 2)
    xs = torch.randn(B, n_ang, K, generator=g, dtype=torch.float64).transpose(1, 2)
    xc, xs = xc.to(DEV), xs.to(DEV)
    assert not xc.is_contiguous()
    w = torch.randn(n_ang, O, K, generator=g, dtype=torch.float64).to(DEV)
    b = torch.randn(O, generator=g, dtype=torch.float64).to(DEV)
    for got, ref in zip(
        linear.equivariant_linear(xc, xs, w, b, path),
        reference.equivariant_linear(xc, xs, w, b),
        strict=True,
    ):
        assert rel_err(got, ref) < 1e-12
    args = _args(6, 10, 7, 2, lead=(2, 3))
    for got, ref in zip(_run(path, args), _run("einsum", args), strict=True):
        assert got.shape == ref.shape and rel_err(got, ref) < 1e-12


@pytest.mark.parametrize("path", FAST)
def test_no_rows_and_no_bias(path):
    args = _args(0, 8, 5, 3)
    y = linear.equivariant_linear(*args, path=path)
    assert y[0].shape == (0, 5, 3)
    args = _args(9, 8, 5, 3, bias=False)
    for got, ref in zip(_run(path, args), _run("einsum", args), strict=True):
        assert rel_err(got, ref) < 1e-12


def test_frozen_weights_compute_only_input_gradients():
    xc, xs, w, b = _args(21, 17, 19, 3)
    w.requires_grad_(False)
    b.requires_grad_(False)
    y = linear.equivariant_linear(xc, xs, w, b, "triton")
    (y[0].sum() + y[1].sum()).backward()
    assert w.grad is None and b.grad is None
    assert xc.grad is not None and xs.grad is not None


@pytest.mark.parametrize("leaf", [True, False], ids=["parameter", "derived"])
@pytest.mark.parametrize(
    "which, kernel", [(2, "eqlin_bwd_w"), (3, "_bias_grad")], ids=["weight", "bias"]
)
def test_parameter_gradient_only_when_the_backward_asks_for_it(
    which, kernel, leaf, monkeypatch
):
    """Forces are ``torch.autograd.grad(energy, positions)``: the weight and the bias
    require grad but nobody asks for theirs, and neither the weight-gradient kernel
    nor the bias's sum (a strided pass over all of g_cos) may run; ``.backward()``
    and a ``grad`` that names the parameter still get it, exactly."""
    calls = []
    real = getattr(linear, kernel)
    monkeypatch.setattr(linear, kernel, lambda *a: calls.append(1) or real(*a))
    args = _args(23, 17, 19, 3)
    p0 = args[which]

    def energy(path="triton"):
        a = list(args)
        a[which] = p0 if leaf else p0 * 1.0  # built from a parameter: not a leaf
        y = linear.equivariant_linear(*a, path)
        return (y[0] ** 2).sum() + (y[1] ** 2).sum()

    (dx,) = torch.autograd.grad(energy(), [args[0]])
    assert calls == [] and dx is not None
    dx2, dp = torch.autograd.grad(energy(), [args[0], p0])
    assert calls == [1] and torch.equal(dx, dx2)
    energy().backward()
    assert calls == [1, 1] and torch.equal(p0.grad, dp)
    (dp_ref,) = torch.autograd.grad(energy("einsum"), [p0])
    assert rel_err(dp, dp_ref) < 1e-12


@pytest.mark.parametrize("n_ang", [1, 3, 5])
def test_weight_gradient_by_gemm_is_the_block_diagonal(n_ang):
    """On CUDA (every dtype but fp64) the weight gradient is one GEMM per cos and
    sin: its block diagonal is the gradient, exactly in fp64."""
    g = G(4)
    gc, gs = (
        torch.randn(41, 13, n_ang, generator=g, dtype=torch.float64) for _ in "cs"
    )
    xc, xs = (torch.randn(41, 9, n_ang, generator=g, dtype=torch.float64) for _ in "cs")
    want = torch.einsum("bom,bkm->mok", gc, xc) + torch.einsum("bom,bkm->mok", gs, xs)
    got = linear._bwd_w_gemm(gc, gs, xc, xs)
    assert got.shape == want.shape and got.is_contiguous()
    assert rel_err(got, want) < 1e-12
    cpu = torch.zeros(2, 3, 3)
    assert not linear._bwd_w_by_gemm(cpu)  # CUDA only (and not fp64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weight_gradient_gemm_in_16_bit_sums_in_fp32(dtype, monkeypatch):
    """16-bit inputs: the two GEMMs are summed in fp32 and rounded once (CUDA's
    ``torch.mm(..., out_dtype=torch.float32)``); where torch's mm has no
    ``out_dtype`` (a TypeError, here forced), each product is rounded to the input
    dtype and widened. Both within 16-bit rounding of the fp64 gradient."""
    g = G(5)
    t64 = [torch.randn(300, 24, 3, generator=g, dtype=torch.float64) for _ in range(4)]
    want = torch.einsum("bom,bkm->mok", t64[0], t64[2]) + torch.einsum(
        "bom,bkm->mok", t64[1], t64[3]
    )
    gc, gs, xc, xs = (t.to(dtype) for t in t64)
    real_mm = torch.mm
    seen = []

    def mm(a, b, *args, **kwargs):  # the CPU has no mm(..., out_dtype): emulate it
        if "out_dtype" in kwargs:
            seen.append(kwargs["out_dtype"])
            if len(seen) > 2:
                raise TypeError("mm() got an unexpected keyword argument 'out_dtype'")
            return real_mm(a.float(), b.float())
        return real_mm(a, b, *args)

    monkeypatch.setattr(torch, "mm", mm)
    exact = linear._bwd_w_gemm(gc, gs, xc, xs)  # fp32 sums (emulated out_dtype)
    rounded = linear._bwd_w_gemm(gc, gs, xc, xs)  # the fallback
    assert seen == [torch.float32] * 4
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    for got in (exact, rounded):
        assert got.dtype == dtype and got.shape == want.shape and got.is_contiguous()
        assert rel_err(got.double(), want) < tol


def test_fma_forward_gets_the_kept_transposed_weight(monkeypatch):
    """Where the Gluon FMA kernel serves a call, ``eqlin_fwd`` hands it W with O
    contiguous: the one W^T that ``_w_t_copy`` keeps, the same tensor for the cos
    and the sin call and for the next forward; an O-contiguous W (the input
    backward's W^T) goes as it is. (The kernel itself is replaced: Gluon does not
    run in the interpreter; its GPU tests are in test_linear_fma.py.)"""
    seen = []

    def fake_fma(x, w, bias, tile):
        seen.append(w)
        return reference.equivariant_linear(x, x, w, bias)[0]

    monkeypatch.setattr(linear, "_config", lambda d, kind="fwd": linear.FP32_FMA)
    monkeypatch.setattr(linear_fma, "fma_reason", lambda x, w: None)
    monkeypatch.setattr(linear_fma, "fma_fwd", fake_fma)
    x_c, x_s, w, b = (t.detach() for t in _args(20, 12, 10, 3))
    want = reference.equivariant_linear(x_c, x_s, w, b)
    for _ in range(2):
        got = linear._EquivariantLinearFn.apply(x_c, x_s, w, b)
        assert all(rel_err(g, r) < 1e-12 for g, r in zip(got, want, strict=True))
    assert len(seen) == 4 and all(t.stride(1) == 1 for t in seen)
    assert len({t.data_ptr() for t in seen}) == 1 and seen[0].data_ptr() != (
        w.data_ptr()
    )
    w_t = w.transpose(1, 2)  # already O contiguous: read in place
    linear.eqlin_fwd(torch.randn(5, 10, 3, dtype=w.dtype, device=w.device), w_t, None)
    assert seen[-1] is w_t


def test_transposed_weight_is_copied_once_until_the_weight_changes():
    """``_w_t_copy`` keeps one W^T per weight: the same tensor while the weight is
    unchanged, a fresh and correct copy after an in-place update, a separate copy
    for another weight (or a view of it), and no entry once the weight is gone."""
    w = torch.randn(3, 5, 7, dtype=torch.float64, requires_grad=True)
    first = linear._w_t_copy(w)
    assert torch.equal(first, w.detach().transpose(1, 2))
    assert first.is_contiguous() and not first.requires_grad
    assert linear._w_t_copy(w) is first
    with torch.no_grad():
        w.mul_(2.0)  # an optimizer step: the version counter moves
    second = linear._w_t_copy(w)
    assert second is not first and torch.equal(second, w.detach().transpose(1, 2))
    view = w[:, :4]
    assert torch.equal(linear._w_t_copy(view), view.detach().transpose(1, 2))
    other = torch.randn(3, 5, 7, dtype=torch.float64)
    assert torch.equal(linear._w_t_copy(other), other.transpose(1, 2))
    keys = {id(w), id(view), id(other)}
    assert keys <= set(linear._W_T)
    del w, view, other, first, second
    assert not keys & set(linear._W_T)


def test_weight_gradient_is_deterministic():
    args = _args(70, 20, 18, 3)
    a = _run("triton", args)
    b = _run("triton", args)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_gradcheck_and_gradgradcheck_of_the_triton_path():
    # small, and fast_mode (random projections): every evaluation is a kernel launch
    # in the interpreter
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


def test_dispatch_follows_the_options_and_the_override(monkeypatch):
    xc, xs, w, b = _args(4, 5, 6, 2)
    calls = []
    apply = linear._EquivariantLinearFn.apply
    monkeypatch.setattr(
        linear._EquivariantLinearFn, "apply", lambda *a: calls.append(1) or apply(*a)
    )
    linear.equivariant_linear(xc, xs, w, b)
    assert calls == []  # default option: the reference
    with options.use(linear="triton"):
        linear.equivariant_linear(xc, xs, w, b)
        assert calls == [1]
        linear.equivariant_linear(xc, xs, w, b, path="dense")  # the override wins
        assert calls == [1]
    with options.use(linear="auto"):  # on a CPU, auto is the reference
        y = linear.equivariant_linear(xc, xs, w, b)
        ref = reference.equivariant_linear(xc, xs, w, b)
        assert torch.equal(y[0], ref[0])
    with pytest.raises(ValueError):
        linear.equivariant_linear(xc, xs, w, b, path="fast")
    with pytest.raises(ValueError):
        ecekern.EquivariantLinear(4, 4, 2, path="fast")


def test_auto_dispatch_table():
    """``auto``: dense where the H200 sweep measured it faster (tensor-core GEMMs up
    to n_ang = 5), the Triton path in strict fp32 at n_ang = 3 (its force step is the
    fastest) and in bf16 at n_ang = 3 where linear_tc serves the shape (its forward,
    force pattern and training were all faster), the einsum everywhere else."""
    f32, bf16 = torch.float32, torch.bfloat16
    assert linear.auto_path("cuda", f32, 3, tf32=True) == "dense"
    assert linear.auto_path("cuda", bf16, 4, tf32=False) == "dense"
    # strict fp32 at n_ang = 3: the Triton path, whose forward is the Gluon FMA
    # kernel (the fastest force step); elsewhere on the FMA units the einsum
    fma = "triton" if linear_fma.gluon is not None else "einsum"
    assert linear.auto_path("cuda", f32, 3, tf32=False) == fma
    assert linear.auto_path("cuda", f32, 2, tf32=False) == "einsum"
    assert linear.auto_path("cuda", f32, 4, tf32=False) == "einsum"
    assert linear.auto_path("cuda", bf16, 5, tf32=False) == "dense"
    assert linear.auto_path("cuda", bf16, 6, tf32=False) == "einsum"  # not measured
    assert linear.auto_path("cuda", torch.float16, 3, tf32=False) == "einsum"
    assert linear.auto_path("cuda", torch.float64, 3, tf32=True) == "einsum"
    assert linear.auto_path("cpu", bf16, 3, tf32=True) == "einsum"
    # bf16 at n_ang = 3: the Triton path only where linear_tc serves the shape
    tc = "triton" if linear_tc.gluon is not None else "dense"
    assert linear.auto_path("cuda", bf16, 3, tf32=False, K=192, O=192) == tc
    assert linear.auto_path("cuda", bf16, 3, tf32=True, K=128, O=256) == tc
    assert linear.auto_path("cuda", bf16, 3, tf32=False) == "dense"  # shape unknown
    assert linear.auto_path("cuda", bf16, 3, tf32=False, K=96, O=192) == "dense"
    assert linear.auto_path("cuda", bf16, 3, tf32=False, K=320, O=192) == "dense"
    assert linear.auto_path("cuda", bf16, 4, tf32=False, K=192, O=192) == "dense"
    assert linear.auto_path("cuda", f32, 3, tf32=True, K=192, O=192) == "dense"
    assert linear.auto_path("cpu", bf16, 3, tf32=False, K=192, O=192) == "einsum"


def test_auto_takes_linear_tc_only_where_it_serves_the_call():
    """In bf16 ``auto`` takes the Triton path only for inputs linear_tc will take
    (contiguous, 16-byte aligned, one dtype): elsewhere the Triton kernel would run,
    slower than the dense GEMM."""
    xc, xs, w, _ = (t.detach() for t in _args(8, 64, 64, 3, torch.bfloat16))
    assert linear._tc_serves(xc, xs, w)
    m_major = xc.transpose(1, 2).contiguous().transpose(1, 2)  # same values
    assert not linear._tc_serves(m_major, xs, w)
    flat = torch.empty(xc.numel() + 1, dtype=xc.dtype)[1:].view(xc.shape)  # 2 B off
    assert not linear._tc_serves(flat, xs, w)
    assert not linear._tc_serves(xc, xs, w.float())


@pytest.mark.parametrize("bias", [True, False])
def test_dense_path_copies_nothing_and_has_no_bmm(bias):
    """The layout churn this chapter removes: forward and backward of the dense path
    issue no ``aten::copy_``, ``clone`` or ``bmm`` (the einsum issues all three). On
    the CPU ``addmm`` itself copies the bias into its output before the GEMM (on CUDA
    the bias is cuBLASLt's epilogue); that copy is the GEMM's, not the layout's."""
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


def test_gpu_launch_per_precision_is_the_launch_sweeps_fastest(monkeypatch):
    """The forward's launch on a GPU, per precision: chapter 2's launch sweep
    picked the strided loads in every precision, at two pipelining stages: plain for
    the FMA dot of strict fp32; for TF32 with the next K step prefetched, one
    interleaved store built by ``tl.join`` and W through a tensor descriptor; for bf16
    with the prefetch and the descriptor, behind the Gluon kernel of linear_tc where
    it serves (``tc``); fp16 the bf16 Triton launch without it."""
    from ecekern import bench

    monkeypatch.setattr(linear, "INTERPRET", False)
    try:
        bench.set_tf32(False)
        strict = linear._config(torch.float32)
        assert linear._reads_w_t_in_place(torch.float32)  # strict fp32: in place
        bench.set_tf32(True)
        tf32 = linear._config(torch.float32)
        assert not linear._reads_w_t_in_place(torch.float32)  # TF32: a W^T copy
        assert linear._reads_w_t_in_place(torch.bfloat16)
    finally:
        bench.set_tf32(False)
    bf16 = linear._config(torch.bfloat16)
    assert strict == linear.FP32_FMA  # the Gluon kernel where it serves (n_ang = 3)
    assert linear.FP32_TRITON == linear.Config(64, 32, 64, 4, 2, False, False)
    assert tf32 == linear.TF32_TRITON and not tf32.tc  # linear_tc lost in TF32
    assert tf32 == linear.Config(64, 32, 64, 4, 2, False, False, True, True, True, True)
    assert bf16 == linear.BF16_TC and bf16.tc
    assert bf16._replace(tc=False) == linear.Config(
        64, 32, 64, 4, 2, False, False, True, False, True
    )
    assert linear._config(torch.float16) == bf16._replace(tc=False)
    # the weight-gradient kernel serves fp64 on CUDA; the rest take the GEMM
    assert linear._config(torch.float64, "bwd_w") == linear.Config(
        32, 16, 32, 4, linear.STAGES, False
    )


def test_unsupported_n_ang_falls_back_loudly():
    options.reset_fallback_warnings()
    args = _args(4, 3, 2, 9)
    with pytest.warns(options.FallbackWarning, match="n_ang"):
        y = linear.equivariant_linear(*args, path="triton")
    assert torch.equal(y[0], reference.equivariant_linear(*args)[0])


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


@pytest.mark.parametrize("path", FAST)
def test_model_energy_and_forces_with_each_path(path):
    cfg = ecekern.ECEConfig(channels=3, radial_hidden=8, readout_hidden=4, n_gated=1)
    model = ecekern.ECEModel(cfg)
    atoms = ecekern.systems.diamond(1, rattle=0.1, seed=4)
    atoms = atoms[:4]
    atoms.pbc = False
    e_ref, f_ref = ecekern.energy_and_forces(model, atoms)
    with options.use(linear=path):
        e, f = ecekern.energy_and_forces(model, atoms, device=DEV)
    assert rel_err(e, e_ref) < 1e-12 and rel_err(f, f_ref) < 1e-10


# ----------------------------------------------------------------------------------
# GPU: precisions with their stated tolerances (fp64 truth from the reference)
# ----------------------------------------------------------------------------------
PRECISIONS = [
    (torch.float64, False, 1e-12),
    (torch.float32, False, 1e-5),
    (torch.float32, True, 3e-3),
    (torch.bfloat16, False, 3e-2),
    (torch.float16, False, 5e-3),
]


def _precision_case(run, dtype, tf32, tol, shape=(4099, 192, 192, 3)):
    from ecekern.bench import set_tf32

    before = torch.backends.cuda.matmul.allow_tf32
    try:
        set_tf32(tf32)
        args64 = [t.detach().requires_grad_() for t in _args(*shape)]
        args = [t.detach().to(dtype).requires_grad_() for t in args64]
        truth = _run("einsum", args64)
        for got, ref in zip(run(args), truth, strict=True):
            assert got.dtype == dtype
            assert rel_err(got, ref) < tol
    finally:
        set_tf32(before)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tf32, tol", PRECISIONS)
@pytest.mark.parametrize("path", FAST)
def test_gpu_precisions(path, dtype, tf32, tol):
    """The public paths at their stated tolerances; calls the Triton path does not
    serve on CUDA must fall back loudly and then match like the reference."""
    if _served(path, dtype, 3):
        _precision_case(lambda a: _run(path, a), dtype, tf32, tol)
    else:
        options.reset_fallback_warnings()
        with pytest.warns(options.FallbackWarning, match="not validated on CUDA"):
            _precision_case(lambda a: _run(path, a), dtype, tf32, tol)


def _kernel_run(args, seed=1):
    """The Triton Function directly, past the CUDA gate."""
    y = linear._EquivariantLinearFn.apply(*args)
    g = torch.Generator().manual_seed(seed)
    gy = [
        torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.device, t.dtype)
        for t in y
    ]
    return list(y) + list(torch.autograd.grad(y, args, gy))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype, tf32, tol, n_ang",
    [
        (torch.float32, False, 1e-5, 3),
        (torch.float32, True, 3e-3, 3),
        (torch.float64, False, 1e-12, 5),
    ],
    ids=["fp32", "tf32", "fp64-n_ang5"],
)
def test_gpu_formerly_failing_cases(dtype, tf32, tol, n_ang):
    """The configurations that gave wrong results in an early H200 run, the kernel
    called directly."""
    _precision_case(_kernel_run, dtype, tf32, tol, (4099, 192, 192, n_ang))


@pytest.mark.gpu
def test_gpu_model_forces_with_the_triton_path():
    model = ecekern.ECEModel(ecekern.ECEConfig())
    atoms = ecekern.systems.diamond(2, seed=3)
    e_ref, f_ref = ecekern.energy_and_forces(model, atoms)
    with options.use(linear="triton"):
        e, f = ecekern.energy_and_forces(model, atoms, device="cuda")
    assert rel_err(e, e_ref) < 1e-12 and rel_err(f, f_ref) < 1e-10


@pytest.mark.parametrize("bdot", [False, True], ids=["per-mode-dots", "batched-dot"])
@pytest.mark.parametrize("n_ang", [1, 2, 3, 5])
def test_both_forward_kernels_match_einsum(bdot, n_ang, monkeypatch):
    """The per-mode kernel and the batched 3-D dot compute the same map (fp64 in the
    interpreter; strict fp32 on the GPU)."""
    if DEV == "cpu":
        cfg, dtype, tol = (
            linear.Config(16, 16, 16, 1, 1, True, bdot),
            torch.float64,
            1e-12,
        )
    else:
        cfg, dtype, tol = (
            linear.Config(32, 32, 64, 4, 1, True, bdot),
            torch.float32,
            1e-5,
        )
    monkeypatch.setattr(linear, "_config", lambda d, kind="fwd": cfg)
    args64 = _args(41, 37, 19, n_ang)
    args = [t.detach().to(dtype).requires_grad_() for t in args64]
    for got, ref in zip(_run("triton", args), _run("einsum", args64), strict=True):
        assert rel_err(got, ref) < tol


VARIANTS = [
    (True, False, False, False),
    (False, True, False, False),
    (False, False, True, False),
    (True, True, True, False),
    (False, True, False, True),
    (True, True, True, True),
]


@pytest.mark.parametrize(
    "prefetch, store3, w_desc, join",
    VARIANTS,
    ids=["pre", "st3", "desc", "pre+st3+desc", "st3+join", "pre+st3+desc+join"],
)
@pytest.mark.parametrize(
    "B, K, O, n_ang",
    [
        (41, 37, 19, 3),
        (16, 16, 16, 1),
        (33, 48, 9, 5),
        (20, 64, 40, 2),
        (24, 20, 33, 4),
    ],
    ids=["awkward", "one-block", "n_ang5", "K-multiple", "n_ang4"],
)
def test_forward_variants_match_einsum_with_all_gradients(
    prefetch, store3, w_desc, join, B, K, O, n_ang, monkeypatch
):
    """The forward's launch variants (the next K step prefetched, the modes stored
    as one interleaved tile, W through a tensor descriptor) compute the same map,
    forward and input backward (W transposed) alike: fp64 in the interpreter,
    strict fp32 on the GPU. K = 37 also exercises the prefetch past the last step;
    the join store serves n_ang 2 to 4 (1 and 5 take the select-and-add one)."""
    flags = (prefetch, store3, w_desc, join)
    if DEV == "cpu":
        cfg = linear.Config(16, 16, 16, 1, 1, False, False, *flags)
        dtype, tol = torch.float64, 1e-12
    else:
        cfg = linear.Config(32, 32, 64, 4, 2, False, False, *flags)
        dtype, tol = torch.float32, 1e-5
    monkeypatch.setattr(linear, "_config", lambda d, kind="fwd": cfg)
    args64 = _args(B, K, O, n_ang)
    args = [t.detach().to(dtype).requires_grad_() for t in args64]
    for got, ref in zip(_run("triton", args), _run("einsum", args64), strict=True):
        assert rel_err(got, ref) < tol


def test_forward_variants_on_non_contiguous_inputs(monkeypatch):
    """m-major x (stride 1 along the rows' features, not the modes) and a W that is
    not contiguous: the variants follow the strides (W is copied for the
    descriptor)."""
    cfg = linear.Config(16, 16, 16, 1, 1, False, False, True, True, True, True)
    if DEV != "cpu":
        cfg = cfg._replace(block_b=32, block_k=32, block_o=64, warps=4, stages=2)
    monkeypatch.setattr(linear, "_config", lambda d, kind="fwd": cfg)
    g = G(5)
    x = torch.randn(3, 29, 21, generator=g, dtype=torch.float64).permute(1, 2, 0)
    w = torch.randn(3, 21, 18, generator=g, dtype=torch.float64).transpose(1, 2)
    b = torch.randn(18, generator=g, dtype=torch.float64)
    x, w, b = (t.to(DEV) for t in (x, w, b))
    assert not x.is_contiguous() and not w.is_contiguous()
    got = linear.eqlin_fwd(x, w, b)
    ref = reference.equivariant_linear(x, x, w, b)[0]
    assert rel_err(got, ref) < 1e-12


@pytest.mark.skipif(linear.TensorDescriptor is None, reason="no host descriptors")
def test_input_backward_reads_w_transposed_without_a_copy(monkeypatch):
    """With W through a descriptor, the forward takes W's own descriptor (mode 1) and
    the input backward one of W's storage read transposed (mode 2), the same weight
    memory both times (no contiguous W^T is made); the gradients match the einsum.
    (Outside TF32: TF32 launches copy W^T, ``test_w_descriptor_only_where...``.)"""
    cfg = linear.Config(16, 16, 16, 1, 1, False, False, True, True, True, True)
    if DEV != "cpu":
        cfg = cfg._replace(block_b=32, block_k=32, block_o=64, warps=4, stages=2)
    monkeypatch.setattr(linear, "_config", lambda d, kind="fwd": cfg)
    seen = []
    real = linear._w_descriptor

    def spy(w, BO, BK, transposed=True):
        out = real(w, BO, BK, transposed)
        seen.append((out[2], w.data_ptr()))
        return out

    monkeypatch.setattr(linear, "_w_descriptor", spy)
    dtype, tol = (torch.float64, 1e-12) if DEV == "cpu" else (torch.float32, 1e-5)
    args64 = _args(24, 32, 48, 3)
    args = [t.detach().to(dtype).requires_grad_() for t in args64]
    for got, ref in zip(_run("triton", args), _run("einsum", args64), strict=True):
        assert rel_err(got, ref) < tol
    assert {mode for mode, _ in seen} == {1, 2}
    assert {ptr for _, ptr in seen} == {args[2].data_ptr()}


@pytest.mark.gpu
def test_gpu_tf32_input_backward_reads_a_copy_of_w_transposed(monkeypatch):
    """TF32 launches take W's descriptor both ways: the input backward reads a
    contiguous copy of W^T (mode 1), one for cos and sin, because a mode-2 tile costs
    TF32 a turn through shared memory in every program; gradients at the TF32
    tolerance."""
    seen = []
    real = linear._w_descriptor

    def spy(w, BO, BK, transposed=True):
        out = real(w, BO, BK, transposed)
        seen.append((out[2], out[0].data_ptr(), out[0]))  # kept alive: no reuse
        return out

    monkeypatch.setattr(linear, "_w_descriptor", spy)
    from ecekern.bench import set_tf32

    args64 = _args(300, 64, 96, 3)
    args = [t.detach().float().requires_grad_() for t in args64]
    before = torch.backends.cuda.matmul.allow_tf32
    set_tf32(True)
    try:
        got = _run("triton", args)
    finally:
        set_tf32(before)
    for g, ref in zip(got, _run("einsum", args64), strict=True):
        assert rel_err(g, ref) < 3e-3
    assert {mode for mode, _, _ in seen} == {1}
    ptrs = {ptr for _, ptr, _ in seen}  # W for the forwards, one W^T for both dx
    assert args[2].data_ptr() in ptrs and len(ptrs) == 2 and len(seen) == 4


@pytest.mark.gpu
@pytest.mark.parametrize("tf32", [False, True], ids=["fp32", "tf32"])
def test_gpu_force_steps_copy_no_weight_after_the_first(tf32):
    """The layer's weight layouts are made once: the strict-fp32 forward's W with O
    contiguous and the TF32 input backward's W^T come from ``_w_t_copy``, so a
    second force-like step (forward, then the input gradient only) runs no
    ``aten::copy_`` at all; after an in-place weight update the next step makes one
    fresh copy and the results follow the new weight."""
    from ecekern.bench import set_tf32

    args64 = _args(600, 192, 192, 3)
    x_c, x_s, w = (t.detach().float() for t in args64[:3])
    w.requires_grad_()
    x_c.requires_grad_()
    x_s.requires_grad_()

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


@pytest.mark.skipif(linear.TensorDescriptor is None, reason="no host descriptors")
def test_w_descriptor_only_where_the_copy_engine_can_serve():
    """A tensor descriptor needs 16-byte aligned strides: W of an odd K in fp64 (8 K
    bytes per row) gets none, and the kernel then loads W by pointers. W transposed
    (the input backward's) is read through a descriptor of its storage, not copied."""
    w_ok = torch.zeros(3, 8, 6, dtype=torch.float64)  # rows of 48 bytes
    w_odd = torch.zeros(3, 8, 5, dtype=torch.float64)  # rows of 40 bytes
    assert linear._w_descriptor(w_ok, 16, 16)[1:] != (None, 0)
    assert linear._w_descriptor(w_ok, 16, 16)[2] == 1
    assert linear._w_descriptor(w_odd, 16, 16)[1:] == (None, 0)
    w_t = w_ok.transpose(1, 2)
    w2, desc, mode = linear._w_descriptor(w_t, 16, 16)
    assert desc is not None and mode == 2 and w2 is w_t
    assert linear._w_descriptor(w_odd.transpose(1, 2), 16, 16)[1:] == (None, 0)
    # TF32's launches ask for no transposed read: W^T is copied, then mode 1
    w4, desc, mode = linear._w_descriptor(w_t, 16, 16, transposed=False)
    assert mode == 1 and w4.is_contiguous() and torch.equal(w4, w_t)
    w_any = torch.zeros(8, 3, 6, dtype=torch.float64).transpose(0, 1)  # neither
    w3, desc, mode = linear._w_descriptor(w_any, 16, 16)
    assert mode == 1 and w3.is_contiguous() and torch.equal(w3, w_any)
