"""The bf16 forward whose modes are split on the tensor cores (ecekern.linear_tc,
Gluon): the 0/1 matrices that do the split, which calls the kernel serves, how the
library hands it W and W^T, and its results against float64 (on a GPU: Gluon does not
run in Triton's CPU interpreter)."""

import pytest
import torch

from ecekern import linear, linear_tc, options, reference
from ecekern.testing import linear_args, rel_err

CUDA = torch.cuda.is_available() and not linear.INTERPRET


def _xw(B, K, O, n=3, dtype=torch.bfloat16, device="cpu", seed=0):
    return linear_args(B, K, O, n, dtype, device, seed)


@pytest.mark.parametrize("G", [16, 8], ids=["bf16", "tf32"])
def test_mode_split_matrices_take_the_modes_apart_exactly(G):
    """One group of G inputs, 3 G interleaved columns, times P (its three G-row
    slices stacked): mode m's G inputs in columns G m .. G m + G - 1, zeros after
    column 3 G - 1, each value exactly once (fp64 and the kernel's dtype alike). In
    bf16 in order; in TF32 in the order of a ``wgmma`` A operand's registers: the
    thread holding accumulator columns 2 t, 2 t + 1 (of 8) holds A columns t, t + 4,
    so A column t + 4 b must be accumulator column 2 t + b."""
    order = list(range(16)) if G == 16 else [2 * (c % 4) + c // 4 for c in range(8)]
    for dtype in (torch.float64, torch.bfloat16 if G == 16 else torch.float32):
        s = linear_tc.mode_split_matrices(dtype, G=G)
        assert s.shape == (3, 4 * G, G) and s.dtype == dtype
        p = torch.cat([s[j].t() for j in range(3)])  # (3 G, 4 G): rows G j + c
        assert torch.equal(p.sum(1), torch.ones(3 * G, dtype=dtype))
        x = torch.randn(7, G, 3, dtype=torch.float64).to(dtype)  # (rows, f, m)
        got = x.reshape(7, 3 * G) @ p
        for m in range(3):
            assert torch.equal(got[:, G * m : G * m + G][:, order], x[:, :, m])
        assert not got[:, 3 * G :].any()
    assert torch.equal(
        linear_tc.mode_split_matrices(torch.float32),
        linear_tc.mode_split_matrices(torch.float64, G=8).float(),
    )


@pytest.mark.skipif(linear_tc.gluon is None, reason="this Triton has no Gluon")
@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda x, w: (x.half(), w.half()), "bf16 and fp32 (TF32) only"),
        (lambda x, w: (x.double(), w.double()), "bf16 and fp32 (TF32) only"),
        (lambda x, w: (x.float(), w.half()), "dtype or device"),
        (lambda x, w: (x[..., :2], w[:2]), "n_ang = 2"),
        (lambda x, w: (x[:, :48], w[:, :, :48]), "multiple of 64"),
        (lambda x, w: (x[:, :48].float(), w[:, :, :48].float()), "multiple of 32"),
        (lambda x, w: (x, w[:, :32]), "O of 64"),
        (lambda x, w: (torch.cat([x] * 5, 1), torch.cat([w] * 5, 2)), "shared memory"),
        (
            lambda x, w: (torch.cat([x] * 4, 1).float(), torch.cat([w] * 4, 2).float()),
            "K = 256 > 192",
        ),
        (lambda x, w: (x.transpose(0, 1).contiguous().transpose(0, 1), w), "contig"),
        (lambda x, w: (x, w), "not a CUDA tensor"),
    ],
    ids=[
        "fp16", "fp64", "mixed", "n_ang2", "K48", "K48-fp32", "O32", "K320",
        "K256-fp32", "strided", "cpu",
    ],
)  # fmt: skip
def test_reason_names_what_the_kernel_cannot_serve(change, reason, monkeypatch):
    x, w, _ = _xw(5, 64, 64)
    x, w = change(x, w)
    if reason in ("dtype or device", "contig"):  # checks made on CUDA tensors only
        monkeypatch.setattr(linear_tc, "shape_reason", lambda *a: None)
    got = linear_tc.tc_reason(x, w)
    assert got is not None and reason in got
    with pytest.raises(ValueError, match="cannot serve"):
        linear_tc.tc_fwd(x, w, None)


@pytest.mark.parametrize(
    "cfg", [linear.BF16_TC, linear.TF32_TRITON._replace(tc=True)], ids=["bf16", "tf32"]
)
def test_forward_and_input_backward_hand_the_kernel_contiguous_weights(
    cfg, monkeypatch
):
    """Where the kernel serves, ``eqlin_fwd`` gives it W as it lies (contiguous) and
    the input backward the one W^T that ``_w_t_copy`` keeps; where it does not
    (K = 48), the Triton launch runs with the ``tc`` switch off. The kernels are
    replaced (Gluon does not run in the interpreter): linear_tc by the reference,
    the Triton kernel by a recorder."""
    seen, launches = [], []

    def fake_tc(x, w, bias):
        seen.append(w)
        return reference.equivariant_linear(x, x, w, bias)[0]

    class FakeTriton:
        def __getitem__(self, grid):
            return lambda *args, **meta: launches.append(meta)

    monkeypatch.setattr(linear, "_config", lambda d, kind="fwd": cfg)
    monkeypatch.setattr(linear_tc, "tc_reason", lambda x, w: None)
    monkeypatch.setattr(linear_tc, "shape_reason", lambda *a: None)
    monkeypatch.setattr(linear_tc, "tc_fwd", fake_tc)
    monkeypatch.setattr(linear, "_eqlin_fwd_kernel", FakeTriton())
    x_c, w, b = _xw(6, 64, 64, dtype=torch.float64)
    x_s = _xw(6, 64, 64, dtype=torch.float64, seed=1)[0]
    x_c.requires_grad_(True)
    y_c, y_s = linear._EquivariantLinearFn.apply(x_c, x_s, w, b)
    want = reference.equivariant_linear(x_c.detach(), x_s, w, b)
    assert rel_err(y_c, want[0]) < 1e-12 and rel_err(y_s, want[1]) < 1e-12
    assert len(seen) == 2 and all(t is w for t in seen) and not launches
    (g,) = torch.autograd.grad(y_c.sum() + y_s.sum(), x_c)
    assert len(seen) == 3 and seen[2] is linear._w_t_copy(w)
    assert seen[2].is_contiguous() and seen[2].shape == (3, 64, 64)
    x_ref = x_c.detach().requires_grad_(True)
    r_c, r_s = reference.equivariant_linear(x_ref, x_s, w, b)
    (g_ref,) = torch.autograd.grad(r_c.sum() + r_s.sum(), x_ref)
    assert rel_err(g, g_ref) < 1e-12
    monkeypatch.setattr(linear_tc, "tc_reason", lambda x, w: "K = 48")
    linear.eqlin_fwd(x_s[:, :48].contiguous(), w[:, :, :48].contiguous(), b)
    assert len(seen) == 3 and len(launches) == 1 and launches[0]["BLOCK_K"] == 32


def _truth(x, w, b):
    return reference.equivariant_linear(
        x.double(), x.double(), w.double(), None if b is None else b.double()
    )[0]


# (B, K, O): programs with one row block (the second consumer idle), with odd and
# even counts of them (20 000 and 9000 rows), and K past two rings (256)
SIZES = [
    (1, 64, 64), (63, 64, 128), (130, 128, 64), (4999, 192, 192), (3, 256, 64),
    (20_000, 64, 64), (9000, 192, 192), (9000, 256, 128),
]  # fmt: skip


SIZES_TF32 = [(1, 32, 64), (63, 96, 128), (130, 64, 64), (4999, 192, 192)]


@pytest.fixture
def tf32():
    """TF32 on for the test (the library's fp32 path then multiplies in TF32)."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def _tc_on(monkeypatch):
    """The path's forward configs with the ``tc`` switch on: TF32 does not run
    linear_tc by default (the Triton kernel is faster), bf16 does."""
    saved = linear._config
    monkeypatch.setattr(
        linear, "_config", lambda d, kind="fwd": saved(d, kind)._replace(tc=True)
    )
    return saved


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize(
    "dtype, B, K, O",
    [(torch.bfloat16, *s) for s in SIZES] + [(torch.float32, *s) for s in SIZES_TF32],
)
def test_gpu_tc_forward_matches_float64(dtype, B, K, O, bias, tf32, monkeypatch):
    """Against float64 of the same inputs: within bf16's rounding of the output, or
    TF32's of the inputs, and as close as the Triton kernel it replaced gets."""
    x, w, b = _xw(B, K, O, dtype=dtype, device="cuda")
    b = b if bias else None
    assert linear_tc.tc_reason(x, w) is None
    y = linear_tc.tc_fwd(x, w, b)
    assert y.shape == (B, O, 3) and y.dtype == dtype
    truth = _truth(x, w, b)
    err = rel_err(y.double(), truth)
    saved = linear._config
    monkeypatch.setattr(
        linear, "_config", lambda d, kind="fwd": saved(d, kind)._replace(tc=False)
    )
    err_triton = rel_err(linear.eqlin_fwd(x, w, b).double(), truth)
    assert err < 4e-3 and err < 1.5 * err_triton + 1e-4, (err, err_triton)
    if dtype == torch.float32:  # TF32 rounds the inputs: about 2^-11 relative
        assert 1e-5 < err < 2e-3, err


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_tc_matches_the_triton_kernel_and_serves_the_path(dtype, tf32, monkeypatch):
    """With the ``tc`` switch on (bf16's default), the path runs linear_tc (forward
    and input backward) at the model's width, and agrees with the Triton kernel to
    within rounding; gradients against float64."""
    x_c, w, b = _xw(4999, 192, 192, dtype=dtype, device="cuda")
    x_s = _xw(4999, 192, 192, dtype=dtype, device="cuda", seed=1)[0]
    calls = []
    real = linear_tc.tc_fwd
    monkeypatch.setattr(
        linear_tc, "tc_fwd", lambda *a: calls.append(a[1].shape) or real(*a)
    )
    assert linear._config(dtype).tc == (dtype == torch.bfloat16)
    saved = _tc_on(monkeypatch)
    x_c.requires_grad_(True)
    y_c, y_s = linear._EquivariantLinearFn.apply(x_c, x_s, w, b)
    (gx,) = torch.autograd.grad((y_c.float() ** 2).sum() + y_s.float().sum(), x_c)
    assert len(calls) == 3  # cos, sin, the input backward of cos (sin needs none)
    monkeypatch.setattr(
        linear, "_config", lambda d, kind="fwd": saved(d, kind)._replace(tc=False)
    )
    t_c = linear.eqlin_fwd(x_c.detach(), w, b)
    assert rel_err(y_c.double(), t_c.double()) < 8e-3
    x64 = x_c.detach().double().requires_grad_(True)
    r_c, r_s = reference.equivariant_linear(x64, x_s.double(), w.double(), b.double())
    (g64,) = torch.autograd.grad((r_c**2).sum() + r_s.sum(), x64)
    assert rel_err(gx.double(), g64) < 1.5e-2


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype, k_odd", [(torch.bfloat16, 96), (torch.float32, 48)])
def test_gpu_calls_it_cannot_serve_run_the_triton_kernel(
    dtype, k_odd, tf32, monkeypatch
):
    """With the ``tc`` switch on, K not a multiple of the K step, and a
    non-contiguous x: the Triton kernel, correct, and linear_tc is not called."""
    _tc_on(monkeypatch)
    monkeypatch.setattr(
        linear_tc, "tc_fwd", lambda *a: pytest.fail("linear_tc ran where it cannot")
    )
    for B, K, O, mangle in ((300, k_odd, 64, False), (300, 64, 64, True)):
        x, w, b = _xw(B, K, O, dtype=dtype, device="cuda")
        if mangle:
            x = x.transpose(0, 1).contiguous().transpose(0, 1)
        y = linear.eqlin_fwd(x, w, b)
        assert rel_err(y.double(), _truth(x, w, b)) < 4e-3


@pytest.mark.skipif(linear_tc.gluon is None, reason="this Triton has no Gluon")
def test_launcher_grid_descriptors_and_device_state(monkeypatch):
    """What ``tc_fwd`` hands the kernel, with the kernel replaced (it needs a GPU):
    x as (B, 3K) and W as (3 O, K) in boxes of 64 rows of 128 bytes, the 0/1
    matrices, one program per SM shared out over the output blocks (at least one
    row program each), and the per-device state made once per dtype."""
    launches = []

    class FakeKernel:
        def __getitem__(self, grid):
            return lambda *args, **meta: launches.append((grid, args, meta))

    class Props:
        multi_processor_count = 132

    made = []
    monkeypatch.setattr(linear_tc, "_DEVICE", {})
    monkeypatch.setattr(linear_tc, "tc_reason", lambda x, w: None)
    monkeypatch.setattr(linear_tc, "_eqlin_fwd_tc_kernel", FakeKernel())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d: made.append(d) or Props()
    )
    for dt, B, K, O, want, consumers in (
        (torch.bfloat16, 4999, 192, 192, (3, 44), 2),
        (torch.bfloat16, 70, 64, 64, (1, 2), 2),
        (torch.bfloat16, 300, 256, 128, (2, 5), 1),  # two rings no longer fit
        (torch.float32, 4999, 192, 192, (3, 44), 1),
        (torch.float32, 70, 96, 128, (2, 2), 1),
    ):
        x, w, b = _xw(B, K, O, dtype=dt)
        y = linear_tc.tc_fwd(x, w, b)
        grid, args, meta = launches[-1]
        assert y.shape == (B, O, 3) and y.dtype == dt and grid == want
        x_desc, w_desc, p = args[:3]
        bk = 64 if dt == torch.bfloat16 else 32  # 128 bytes a box row
        assert list(x_desc.shape) == [B, 3 * K] and x_desc.block_shape == [64, bk]
        assert list(w_desc.shape) == [3 * O, K] and w_desc.block_shape == [64, bk]
        assert torch.equal(p, linear_tc.mode_split_matrices(dt))
        assert meta["NKB"] == K // bk and meta["HAS_BIAS"]
        ln = linear_tc.launch(dt, K)
        assert ln.consumers == consumers
        assert (meta["C"], meta["STAGES"], meta["CONSUMER_REGS"]) == ln[1:]
    assert made == [0, 0]  # the state is made once per device and dtype
    assert linear_tc.tc_fwd(*_xw(0, 64, 64)[:2], None).shape == (0, 64, 3)
    assert len(launches) == 5  # no rows, no launch


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (Gluon)")
def test_auto_runs_linear_tc_in_bf16_where_it_serves(monkeypatch):
    """``auto`` in bf16 at n_ang = 3: linear_tc for contiguous inputs of a shape it
    serves, forward and input backward, with the dense path's result within bf16
    rounding; the dense GEMM for m-major inputs (no kernel call)."""
    calls = []
    real = linear_tc.tc_fwd
    monkeypatch.setattr(linear_tc, "tc_fwd", lambda *a: calls.append(1) or real(*a))
    xc, w, b = linear_args(300, 64, 128, 3, torch.bfloat16, "cuda", 3)
    xs = linear_args(300, 64, 128, 3, torch.bfloat16, "cuda", 4)[0]
    xc.requires_grad_()
    gy = [torch.randn(300, 128, 3, device="cuda") for _ in range(2)]

    def loss(y):
        return (y[0].float() * gy[0]).sum() + (y[1].float() * gy[1]).sum()

    with options.use(linear="auto"):  # the process-wide default is the reference
        y = linear.equivariant_linear(xc, xs, w, b)
    assert len(calls) == 2  # cos and sin
    (dx,) = torch.autograd.grad(loss(y), [xc])
    assert len(calls) == 3  # x_cos's gradient; x_sin asks for none
    want = linear.equivariant_linear(xc, xs, w, b, "dense")
    (dx_want,) = torch.autograd.grad(loss(want), [xc])
    for a, r in zip((*y, dx), (*want, dx_want), strict=True):
        assert rel_err(a.float(), r.float()) < 1e-2
    m_major = xs.detach().transpose(1, 2).contiguous().transpose(1, 2)
    with options.use(linear="auto"):
        linear.equivariant_linear(xc.detach(), m_major, w, b)
    assert len(calls) == 3
