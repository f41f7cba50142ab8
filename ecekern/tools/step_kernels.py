"""Chapter 7's kernels built offline for sm_90 (no GPU): registers, spills and
shared memory per program at the library's launches, the book's widths.

    python -m ecekern.tools.step_kernels    # JSON rows, one per kernel and variant

Status: needs Triton with its NVIDIA tools (``registers.available()``).
"""

from __future__ import annotations

import json
import sys

from .registers import H200, _usage, available

__all__ = ["geometry_kernels", "radial_kernels"]


def _build(kernel, consts: dict, types: dict, warps: int, stages: int = 3) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {n: types.get(n, "i32") for n in kernel.arg_names}
    signature |= {n: "constexpr" for n in consts}
    compiled = triton.compile(
        ASTSource(fn=kernel, signature=signature, constexprs=consts),
        target=GPUTarget(*H200),
        options={"num_warps": warps, "num_stages": stages},
    )
    return _usage(compiled)


def radial_kernels(sizes=(8, 64, 64, 448)) -> list[dict]:
    """The radial forward and backward at ``(n_rbf, H1, H2, O)``, every dtype and
    precision (sm_90 allows 227 KB of shared memory per program)."""
    import triton.language as tl

    from ..step import radial

    n_rbf, H1, H2, O = sizes
    launch = radial.RadialLaunch()
    rows = []
    for kernel in (radial._radial_fwd_kernel, radial._radial_bwd_d_kernel):
        for dt, prec in (("fp32", "ieee"), ("fp32", "tf32x3"), ("fp32", "tf32"),
                         ("fp64", "ieee")):  # fmt: skip
            consts = dict(
                NR=n_rbf, H1=H1, H2=H2, O=O, NR_PAD=radial._pad(n_rbf),
                H1_PAD=radial._pad(H1), H2_PAD=radial._pad(H2),
                BLOCK_E=launch.block_e,
                BLOCK_O=min(radial._pad(launch.block_o), radial._pad(O)),
                P=radial.ENVELOPE_P, PREC=prec,
                DT=tl.float64 if dt == "fp64" else tl.float32,
            )  # fmt: skip
            types = {n: "*" + dt for n in kernel.arg_names if n.endswith("_ptr")}
            types |= {n: "fp32" for n in kernel.arg_names
                      if n not in consts and n not in types and n != "E"
                      and not n.startswith("stride")}  # fmt: skip
            rows.append(dict(kernel=kernel.fn.__name__, dtype=dt, precision=prec)
                        | _build(kernel, consts, types, launch.warps,
                                 launch.stages))  # fmt: skip
    return rows


def geometry_kernels() -> list[dict]:
    """The geometry forward and adjoint for every (L, M) the tiles cover, fp32 and
    fp64, padded graphs."""
    from ..step import geometry

    rows = []
    for kernel in (geometry._geometry_fwd_kernel, geometry._geometry_bwd_kernel):
        for dt in ("fp32", "fp64"):
            for L, M in sorted(geometry.VARIANTS):
                consts = dict(L=L, M=M, PADDED=True, BLOCK=geometry.BLOCK)
                types = {n: ("*i64" if n in ("src_ptr", "dst_ptr", "shift_ptr")
                             else "*" + dt)
                         for n in kernel.arg_names if n.endswith("_ptr")}  # fmt: skip
                types |= {n: "fp32" for n in kernel.arg_names
                          if n not in consts and n not in types
                          and n != "E"}  # fmt: skip
                rows.append(
                    dict(kernel=kernel.fn.__name__, dtype=dt, L=L, M=M)
                    | _build(kernel, consts, types, geometry.WARPS)
                )
    return rows


def main() -> int:
    if not available():
        print("needs Triton with its NVIDIA tools (Linux wheels)")
        return 1
    print(json.dumps({"radial": radial_kernels(), "geometry": geometry_kernels()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
