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


TARGETS = {"copy": copy, "gemm": gemm, "force_step": force_step}

if __name__ == "__main__":
    TARGETS[sys.argv[1]]()
