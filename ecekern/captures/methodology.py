"""The methodology chapter's capture: the roofline of the H200 by our own harness.

* ``ceilings`` -> ceilings.csv (kernel schema): device copy bandwidth (a
  ``cudaMemcpy`` and a read-one-write-one kernel, ``torch.neg``) over buffer sizes,
  and the GEMM rates of each precision;
* ``ncu`` -> ncu_copy.csv, ncu_gemm.csv: Nsight Compute's view of one copy and one
  GEMM.
"""

from __future__ import annotations

import torch

from .. import bench
from . import schema
from .common import free, ncu_part, switched

__all__ = ["PARTS"]

#: The GEMMs timed, (dtype, TF32): fp64, strict fp32, TF32, bf16, fp16.
GEMMS = ((torch.float64, False), (torch.float32, False), (torch.float32, True),
         (torch.bfloat16, False), (torch.float16, False))  # fmt: skip


def _ceilings(run, arg: str) -> str:
    """ceilings.csv (module docstring)."""
    rows = []
    sizes = [2**26, 2**28] if run.quick else [2**24, 2**26, 2**28, 2**30, 2**32]
    for nbytes in sizes:
        src = torch.randn(nbytes // 4, device="cuda")
        dst = torch.empty_like(src)
        for kind, fn in (
            ("copy", lambda src=src, dst=dst: dst.copy_(src)),
            ("elementwise", lambda src=src, dst=dst: torch.neg(src, out=dst)),
        ):
            t = bench.time_fn(fn)
            problem = f"{nbytes / 2**20:.0f} MiB"
            rows.append(schema.kernel_row(kind, problem, nbytes // 4, "float32", t,
                                          2 * nbytes, 0))  # fmt: skip
        del src, dst
        free()
    n = 4096 if run.quick else 8192
    for dtype, tf32 in GEMMS:
        with switched({}, tf32):
            a = torch.randn(n, n, device="cuda", dtype=dtype)
            b = torch.randn(n, n, device="cuda", dtype=dtype)
            t = bench.time_fn(lambda a=a, b=b: a @ b)
        nbytes = 3 * n * n * a.element_size()
        rows.append(schema.kernel_row("gemm", f"{n}^3", n, bench.dtype_label(dtype),
                                      t, nbytes, 2 * n**3))  # fmt: skip
        del a, b
        free()
    for r in rows:  # a copy's rate is its bandwidth, a GEMM's its FLOP rate
        r["GBps" if r["kernel"] == "gemm" else "TFLOPs"] = ""
    schema.write(rows, run.out / "ceilings.csv", schema.KERNEL_COLUMNS)
    return "done"


_ncu = ncu_part({"copy": ("copy", None), "gemm": ("gemm", None)})
PARTS = {"ceilings": _ceilings, "ncu": _ncu}
GPU_ONLY = ("ceilings", "ncu")
