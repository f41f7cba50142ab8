"""Registers, local-memory stack and shared memory of a Triton kernel, without a GPU.

Triton compiles for any target on a CPU machine, and its Linux wheel ships NVIDIA's
``ptxas`` and ``cuobjdump``: compile for sm_90 (the H200), ask ``cuobjdump -res-usage``
what the cubin uses. A kernel that needs more than 255 registers per thread spills to
a per-thread stack in local memory (DRAM behind L1), which is what turns a register
tile that is too large into a slow kernel.

    python -m ecekern.captures.registers      # the zonal backward's launches, JSON

Run it in a process without ``TRITON_INTERPRET`` (the interpreter replaces the
kernels with Python functions that cannot be compiled).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover - no Triton on this platform
    triton = None

H200 = ("cuda", 90, 32)


def _tools_dir() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def available() -> bool:
    """Whether this machine can compile and inspect sm_90 cubins."""
    return triton is not None and os.path.exists(
        os.path.join(_tools_dir(), "cuobjdump")
    )


def resource_usage(
    kernel, types: dict, constexprs: dict, num_warps: int, target=H200
) -> dict:
    """Compile ``kernel`` for ``target`` and read its resource usage.

    Args:
        kernel: a ``@triton.jit`` function.
        types: Triton type strings of the non-constexpr arguments that are not
            ``i32`` (``"*fp32"``, ``"*i64"``, ``"fp32"``...); the rest are ``i32``.
        constexprs: values of the constexpr arguments.
        num_warps: warps per program.

    Returns:
        ``{"registers": per thread, "stack_bytes": per thread (spills), "shared_bytes":
        per program}``.
    """
    signature = {n: types.get(n, "i32") for n in kernel.arg_names}
    signature.update({n: "constexpr" for n in constexprs})
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    compiled = triton.compile(
        src, target=GPUTarget(*target), options={"num_warps": num_warps}
    )
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as fh:
            fh.write(compiled.asm["cubin"])
        out = subprocess.run(
            [os.path.join(_tools_dir(), "cuobjdump"), "-res-usage", path],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    return {
        "registers": int(re.search(r"REG:(\d+)", out).group(1)),
        "stack_bytes": int(re.search(r"STACK:(\d+)", out).group(1)),
        "shared_bytes": int(compiled.metadata.shared),
    }


def zonal_gather(L: int, C: int, block_e: int, warps: int) -> dict:
    """Resource usage of the zonal backward (edge gather) at one launch, fp32."""
    from .. import zonal

    k = zonal._zonal_gather_kernel
    types = {n: "*fp32" for n in k.arg_names if n.endswith("_ptr")}
    types.update(dst_ptr="*i64", l_idx_ptr="*i32", scale_hi="fp32", scale_lo="fp32")
    const = {
        "L": L,
        "S_PAD": triton.next_power_of_2((L + 1) ** 2 - 1),
        "C_PAD": triton.next_power_of_2(C),
        "BLOCK_E": block_e,
        "ACC_DTYPE": triton.language.float32,
    }
    return resource_usage(k, types, const, warps)


#: The edge gather's launch in chapter 5's first capture (85534791f806): BLOCK_E 16
#: at every shape, 2 warps.
FIXED_LAUNCH = (16, 2)


def zonal_table(cases=None) -> list[dict]:
    """The zonal backward at the shapes of chapter 5's sweep: the fixed launch of the
    first capture against the one the tile rule and ``zonal.CONFIG`` give now."""
    from .. import zonal

    cases = cases or [(3, 32), (4, 32), (3, 64), (3, 100)]
    rows = []
    for L, C in cases:
        S_PAD = triton.next_power_of_2((L + 1) ** 2 - 1)
        C_PAD = triton.next_power_of_2(C)
        rule = zonal.edges_per_block(zonal.CONFIG["bwd_tile"], S_PAD, C_PAD)
        launches = (
            ("first capture: fixed BLOCK_E", *FIXED_LAUNCH),
            ("now: tile rule", rule, zonal.CONFIG["bwd_warps"]),
        )
        for label, be, warps in launches:
            rows.append(
                {"L": L, "C": C, "launch": label, "block_e": be, "warps": warps}
                | zonal_gather(L, C, be, warps)
            )
    return rows


def main() -> int:
    if not available():
        print("needs Triton with its NVIDIA tools (Linux wheels)")
        return 1
    print(json.dumps(zonal_table()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
