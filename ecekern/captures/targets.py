"""Programs for Nsight Compute: ``python -m ecekern.captures.targets NAME``.

Each runs its work a few times to warm up, then once more inside the NVTX range
``ece`` that the capture's ``ncu --nvtx --nvtx-include ece/`` selects.
"""

from __future__ import annotations

import sys

import torch


def _in_range(fn, warmup: int = 2):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("ece")
    fn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()


def copy():
    # an elementwise kernel: a same-dtype copy_ is a cudaMemcpy, which ncu cannot see
    src = torch.randn(256 * 2**20, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    _in_range(lambda: torch.neg(src, out=dst))


def gemm():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    _in_range(lambda: a @ b)


def force_step(repeats: int = 4):
    import ecekern
    from ecekern.model import force_step as step
    from ecekern.model import prepare_inputs

    model = ecekern.ECEModel().to(device="cuda", dtype=torch.float32)
    inputs = prepare_inputs(
        ecekern.systems.diamond(repeats), model.config.cutoff, torch.float32, "cuda"
    )
    _in_range(lambda: step(model, *inputs))


def _eqlin_inputs(E: int, F: int, n_ang: int):
    """``([x_cos, x_sin], w, b)`` on the GPU in strict fp32, TF32 and bf16, with TF32
    switched on for its turn and off after: the inputs of the EquivariantLinear
    targets."""
    from ecekern import bench

    for dtype, tf32 in (
        (torch.float32, False),
        (torch.float32, True),
        (torch.bfloat16, False),
    ):
        bench.set_tf32(tf32)
        x = [torch.randn(E, F, n_ang, device="cuda", dtype=dtype) for _ in range(2)]
        w = (torch.randn(n_ang, F, F, device="cuda") / F**0.5).to(dtype)
        b = torch.randn(F, device="cuda", dtype=dtype)
        yield x, w, b
    bench.set_tf32(False)


def eqlin_triton(E: int = 47_000, F: int = 192, n_ang: int = 3):
    """The Triton forward (cos and sin) in strict fp32, TF32 and bf16, each at the
    capture's chosen launch (``ECEKERN_LINEAR_CONFIG``, by dtype label), then strict
    fp32 with the Triton kernel that the Gluon FMA kernel replaced."""
    import json
    import os

    from ecekern import bench, linear

    chosen = json.loads(os.environ.get("ECEKERN_LINEAR_CONFIG", "{}"))
    default = linear._config

    def pick(dtype, kind="fwd"):
        label = bench.dtype_label(dtype)
        if kind == "fwd" and label in chosen:
            return linear.Config(*chosen[label])
        return default(dtype, kind)

    linear._config = pick
    for x, w, b in _eqlin_inputs(E, F, n_ang):
        _in_range(lambda x=x, w=w, b=b: linear._EquivariantLinearFn.apply(*x, w, b))
    # strict fp32 once more with the Triton kernel (tl.dot on the FMA units), which
    # the Gluon kernel of ecekern.linear_fma replaced there: the last two kernels
    linear._config = lambda d, kind="fwd": (
        linear.FP32_TRITON if kind == "fwd" else default(d, kind)
    )
    x = [torch.randn(E, F, n_ang, device="cuda") for _ in range(2)]
    w = torch.randn(n_ang, F, F, device="cuda") / F**0.5
    b = torch.randn(F, device="cuda")
    _in_range(lambda: linear._EquivariantLinearFn.apply(*x, w, b))


def eqlin_dense(E: int = 47_000, F: int = 192, n_ang: int = 3):
    """The dense path's forward (cos and sin: the block-diagonal weight's assembly,
    then cuBLAS) in strict fp32, TF32 and bf16, the same inputs as
    :func:`eqlin_triton`: what the Triton kernel is up against."""
    from ecekern import linear

    for x, w, b in _eqlin_inputs(E, F, n_ang):
        _in_range(lambda x=x, w=w, b=b: linear._dense(*x, w, b))


def zonal_fused(E: int = 365_000, L: int = 3, C: int = 32):
    """The gather (backward) and the forward with the capture's chosen launch
    (``ECEKERN_ZONAL_CONFIG``), then each forward variant at its own best launch
    (``ECEKERN_ZONAL_NCU_FORWARDS``), all set by the chapter-5 capture."""
    import json
    import os

    from ecekern import zonal
    from ecekern.graph import csr_row_ptr

    zonal.CONFIG.update(json.loads(os.environ.get("ECEKERN_ZONAL_CONFIG", "{}")))
    N = E // 89
    dst = torch.sort(torch.randint(0, N, (E,), device="cuda")).values
    row_ptr = csr_row_ptr(dst, N)
    Z = torch.randn(E, (L + 1) ** 2 - 1, device="cuda")
    R = torch.randn(E, L, C, device="cuda")
    G = torch.randn(N, (L + 1) ** 2, C, device="cuda")
    _in_range(lambda: zonal._gather_op(G, Z, R, dst, row_ptr, 0.1))
    _in_range(lambda: zonal._scatter_op(Z, R, dst, row_ptr, 0.1), warmup=1)
    forwards = json.loads(os.environ.get("ECEKERN_ZONAL_NCU_FORWARDS", "[]"))
    for variant, block_e, warps, stages, acc in forwards:
        tile = block_e * zonal.fwd_rows(variant, L) * C
        zonal.CONFIG.update(
            forward=variant,
            fwd_tile=tile,
            fwd_warps=warps,
            fwd_stages=stages,
            fwd_acc=acc,
        )
        _in_range(lambda: zonal._scatter_op(Z, R, dst, row_ptr, 0.1), warmup=1)


TARGETS = {
    "copy": copy,
    "gemm": gemm,
    "force_step": force_step,
    "eqlin_triton": eqlin_triton,
    "eqlin_dense": eqlin_dense,
    "zonal_fused": zonal_fused,
}

if __name__ == "__main__":
    TARGETS[sys.argv[1]]()
