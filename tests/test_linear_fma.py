"""The strict-fp32 forward on the FMA units (ecekern.linear_fma, Gluon): which calls it
serves (everywhere), and its results against float64 (on a GPU: Gluon does not run in
Triton's CPU interpreter)."""

import pytest
import torch

from ecekern import bench, linear, linear_fma, reference
from ecekern.testing import linear_args, rel_err

CUDA = torch.cuda.is_available() and not linear.INTERPRET


def _xw(B, K, O, n=3, dtype=torch.float32, device="cpu", seed=0):
    return linear_args(B, K, O, n, dtype, device, seed)


@pytest.mark.skipif(linear_fma.gluon is None, reason="this Triton has no Gluon")
@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda x, w: (x.double(), w.double()), "fp32 only"),
        (lambda x, w: (x.bfloat16(), w.bfloat16()), "fp32 only"),
        (lambda x, w: (x[..., :2], w[:2]), "n_ang = 2"),
        (lambda x, w: (x.transpose(0, 1).contiguous().transpose(0, 1), w), "rows"),
        (lambda x, w: (x.permute(2, 0, 1).contiguous().permute(1, 2, 0), w), "rows"),
        (lambda x, w: (x, w), "not a CUDA tensor"),
    ],
    ids=["fp64", "bf16", "n_ang2", "x-feature-major", "x-m-major", "cpu"],
)
def test_reason_names_what_the_kernel_cannot_serve(change, reason):
    x, w, _ = _xw(5, 16, 8)
    x, w = change(x, w)
    got = linear_fma.fma_reason(x, w)
    assert got is not None and reason in got
    with pytest.raises(ValueError, match="cannot serve"):
        linear_fma.fma_fwd(x, w, None)


def test_tf32_is_a_reason():
    x, w, _ = _xw(5, 16, 8)
    try:
        bench.set_tf32(True)
        assert "TF32" in linear_fma.fma_reason(x, w)
    finally:
        bench.set_tf32(False)


def test_strict_fp32_forward_dispatches_to_the_fma_kernel_where_it_serves(
    monkeypatch,
):
    """The launcher's choice, with the GPU's configuration on any machine: the Gluon
    kernel where ``fma_reason`` is None, else the Triton kernel (still exact)."""
    x, w, b = _xw(37, 20, 35)
    truth = reference.equivariant_linear(x.double(), x.double(), w.double(), b.double())
    calls = []

    def spy(x_, w_, b_, tile):
        calls.append(tile)
        return reference.equivariant_linear(x_, x_, w_, b_)[0].contiguous()

    monkeypatch.setattr(linear, "_config", lambda d, kind="fwd": linear.FP32_FMA)
    monkeypatch.setattr(linear_fma, "fma_fwd", spy)
    monkeypatch.setattr(linear_fma, "fma_reason", lambda x_, w_: None)
    y = linear.eqlin_fwd(x, w, b)
    assert calls == ["8x4"] and rel_err(y, truth[0]) < 1e-6
    if linear.INTERPRET:  # the Triton kernel takes the calls the Gluon one cannot
        monkeypatch.setattr(linear_fma, "fma_reason", lambda x_, w_: "n_ang")
        monkeypatch.setattr(linear, "_config", lambda d, kind="fwd": linear.FP32_FMA)
        monkeypatch.setattr(
            linear, "FP32_TRITON", linear.Config(16, 16, 16, 1, 1, False)
        )
        y = linear.eqlin_fwd(x, w, b)
        assert calls == ["8x4"] and rel_err(y, truth[0]) < 1e-6


# --------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------
SIZES = [
    (4999, 192, 192),  # the chapter's width, a partial last block of rows
    (1000, 96, 72),  # a partial block of outputs
    (3, 192, 192),  # fewer rows than a block
    (70, 100, 130),  # K not a multiple of 16: the masked loads
    (1, 17, 5),
    (0, 16, 16),
    (7, 0, 16),  # no inputs: the bias alone
]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("tile", list(linear_fma.TILES))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("B, K, O", SIZES)
def test_gpu_fma_forward_matches_float64(B, K, O, bias, tile):
    bench.set_tf32(False)
    x, w, b = _xw(B, K, O, device="cuda")
    b = b if bias else None
    y = linear_fma.fma_fwd(x, w, b, tile)
    truth = reference.equivariant_linear(
        x.double(), x.double(), w.double(), b.double() if bias else None
    )[0]
    assert y.shape == truth.shape and y.dtype == torch.float32
    if B:
        assert rel_err(y, truth) < 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("B, K, O", SIZES[:4])
def test_gpu_fma_input_backward_reads_w_transposed_in_place(B, K, O):
    """``dx = dy W``: the kernel with W's transpose, O contiguous, read where it
    lies (no copy)."""
    bench.set_tf32(False)
    x, w, _ = _xw(B, K, O, device="cuda", seed=2)
    g = torch.randn(B, O, 3, device="cuda", dtype=torch.float32)
    wt = w.transpose(1, 2)
    assert linear_fma.o_contiguous(wt) is wt
    assert linear_fma.o_contiguous(w).stride(1) == 1
    dx = linear_fma.fma_fwd(g, wt, None)
    truth = torch.einsum("bom,moi->bim", g.double(), w.double())
    assert rel_err(dx, truth) < 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_strict_fp32_path_runs_the_fma_kernel_both_ways(monkeypatch):
    """Forward and input backward of the Triton path in strict fp32 go through the
    Gluon kernel (cos and sin each way), the weight gradient through one GEMM per
    cos and sin, with all gradients within fp32 of float64;
    an x with m-major strides has its forward from the Triton kernel instead."""
    bench.set_tf32(False)
    calls = []
    real = linear_fma.fma_fwd

    def spy(*a, **k):
        calls.append((a[1].data_ptr(), a[1].stride()))
        return real(*a, **k)

    monkeypatch.setattr(linear_fma, "fma_fwd", spy)
    gemm = []
    real_gemm = linear._bwd_w_gemm
    monkeypatch.setattr(
        linear, "_bwd_w_gemm", lambda *a: gemm.append(1) or real_gemm(*a)
    )
    for m_major in (False, True):
        calls.clear()
        xs = [_xw(4099, 192, 160, device="cuda", seed=s)[0] for s in (3, 4)]
        if m_major:
            xs = [x.permute(2, 0, 1).contiguous().permute(1, 2, 0) for x in xs]
        _, w, b = _xw(4099, 192, 160, device="cuda", seed=5)
        args = [t.clone().requires_grad_() for t in (*xs, w, b)]
        y = linear._EquivariantLinearFn.apply(*args)
        gy = [torch.randn_like(t) for t in y]
        grads = torch.autograd.grad(y, args, gy)
        a64 = [t.detach().double().requires_grad_() for t in args]
        y64 = reference.equivariant_linear(*a64)
        g64 = torch.autograd.grad(y64, a64, [t.double() for t in gy])
        for got, ref in zip([*y, *grads], [*y64, *g64], strict=True):
            assert rel_err(got, ref) < 1e-5
        # every call reads W with O contiguous: the forward one transposed copy of
        # W for cos and sin, the input backward W^T where it lies; an m-major x has
        # its forward from the Triton kernel (dy is contiguous: the backward is not)
        assert all(stride[1] == 1 for _, stride in calls)
        backward = [c for c in calls if c[0] == args[2].data_ptr()]
        forward = [c for c in calls if c[0] != args[2].data_ptr()]
        assert len(backward) == 2 and len(forward) == (0 if m_major else 2)
        assert len({p for p, _ in forward}) <= 1  # one copy, shared
    assert gemm == [1, 1]  # the weight gradient by one GEMM per backward
