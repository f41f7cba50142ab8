"""The methodology chapter's capture: the roofline of the H200 by our own harness."""

from __future__ import annotations

from pathlib import Path

import torch

from .. import bench
from .common import free, parse_parts, run_ncu

__all__ = ["capture"]

PARTS = ("ceilings", "ncu")


def capture(
    out: Path,
    quick: bool = False,
    ncu: bool = True,
    parts: str = "ceilings,ncu",
    boxes: str | None = None,
) -> dict:
    """Device copy bandwidth and GEMM rates (``ceilings.csv``), and Nsight Compute's
    view of one copy and one GEMM (``ncu_copy.csv``, ``ncu_gemm.csv``)."""
    todo = parse_parts(parts, PARTS)
    info: dict = {"parts": sorted(todo)}
    if "ceilings" in todo:
        bench.write_csv(_ceiling_rows(quick), out / "ceilings.csv")
    if ncu and "ncu" in todo:
        info["ncu_copy"] = run_ncu("copy", out / "ncu_copy.csv")
        info["ncu_gemm"] = run_ncu("gemm", out / "ncu_gemm.csv")
    return info


def _ceiling_rows(quick: bool) -> list[dict]:
    rows = []
    sizes = [2**26, 2**28] if quick else [2**24, 2**26, 2**28, 2**30, 2**32]
    for nbytes in sizes:
        src = torch.randn(nbytes // 4, device="cuda")
        dst = torch.empty_like(src)
        # a same-dtype copy_ is a cudaMemcpy; torch.neg is a read-one-write-one kernel
        for kind, fn in (
            ("copy", lambda src=src, dst=dst: dst.copy_(src)),
            ("elementwise", lambda src=src, dst=dst: torch.neg(src, out=dst)),
        ):
            t = bench.time_fn(fn)
            rows.append(
                {
                    "kind": kind,
                    "case": f"{nbytes / 2**20:.0f} MiB",
                    "bytes": 2 * nbytes,
                    "flops": 0,
                    "median_ms": t.median,
                    "p10_ms": t.p10,
                    "p90_ms": t.p90,
                    "rate": 2 * nbytes / t.median / 1e6,
                    "unit": "GB/s",
                    **bench.provenance(torch.float32),
                }
            )
        del src, dst
        free()
    n = 4096 if quick else 8192
    try:
        for dtype, tf32 in [
            (torch.float64, False),
            (torch.float32, False),
            (torch.float32, True),
            (torch.bfloat16, False),
            (torch.float16, False),
        ]:
            bench.set_tf32(tf32)
            a = torch.randn(n, n, device="cuda", dtype=dtype)
            b = torch.randn(n, n, device="cuda", dtype=dtype)
            t = bench.time_fn(lambda a=a, b=b: a @ b)
            rows.append(
                {
                    "kind": "gemm",
                    "case": f"{n}^3",
                    "bytes": 3 * n * n * a.element_size(),
                    "flops": 2 * n**3,
                    "median_ms": t.median,
                    "p10_ms": t.p10,
                    "p90_ms": t.p90,
                    "rate": 2 * n**3 / t.median / 1e9,
                    "unit": "TFLOP/s",
                    **bench.provenance(dtype),
                }
            )
            del a, b
            free()
    finally:
        bench.set_tf32(False)
    return rows
