"""Registers, local-memory stack and shared memory of a Triton kernel, without a GPU.

Triton compiles for any target on a CPU machine, and its Linux wheel ships NVIDIA's
``ptxas`` and ``cuobjdump``: compile for sm_90 (the H200), ask ``cuobjdump -res-usage``
what the cubin uses. A kernel that needs more than 255 registers per thread spills to
a per-thread stack in local memory (DRAM behind L1), which is what turns a register
tile that is too large into a slow kernel.

    python -m ecekern.tools.registers      # the zonal backward's launches, JSON
    python -m ecekern.tools.registers --zonal-variants   # every zonal kernel
    python -m ecekern.tools.registers --linear-layouts   # chapter 2's tile layouts
    python -m ecekern.tools.registers --linear-fp32 [CSV]  # chapter 2's FMA kernels
    python -m ecekern.tools.registers --linear-tc   # the tensor-core kernel
    python -m ecekern.tools.registers --edge-layer [CSV]  # chapter 8's two kernels

Run it in a process without ``TRITON_INTERPRET`` (the interpreter replaces the
kernels with Python functions that cannot be compiled).
"""

from __future__ import annotations

import itertools
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
    return _usage(_compile(kernel, types, constexprs, num_warps, target))


def _usage(compiled) -> dict:
    """Registers and stack per thread (cuobjdump), shared memory per program."""
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


def _compile(kernel, types: dict, constexprs: dict, num_warps: int, target=H200):
    signature = {n: types.get(n, "i32") for n in kernel.arg_names}
    signature.update({n: "constexpr" for n in constexprs})
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(
        src, target=GPUTarget(*target), options={"num_warps": num_warps}
    )


def memory_layouts(
    kernel, types: dict, constexprs: dict, num_warps: int, target=H200
) -> list[dict]:
    """The register layout of every global load and store of ``kernel`` compiled for
    ``target`` (arguments as for :func:`resource_usage`): which axis of each tile a
    warp's threads run along. ``[{"op", "shape", "threads_per_warp", "order"}]``,
    ``order[0]`` the fastest axis; loads the pipeliner turned into asynchronous
    copies are listed as ``async_copy``."""
    ttgir = _compile(kernel, types, constexprs, num_warps, target).asm["ttgir"]
    blocked = {
        m.group(1): m.group(2)
        for m in re.finditer(r"^(#\w+) = #ttg\.blocked<\{(.*?)\}>", ttgir, re.M)
    }

    def ints(text, key):
        return [
            int(v) for v in re.search(key + r" = \[([0-9, ]*)\]", text)[1].split(",")
        ]

    rows = []
    pattern = (
        r"(tt\.load|tt\.store|ttg\.async_copy_global_to_local) "
        r".*?tensor<([0-9x]+)x!tt\.ptr<\w+>, (#\w+)>"
    )
    for m in re.finditer(pattern, ttgir):
        layout = blocked.get(m.group(3))
        if layout is None:  # a linear or slice layout: not a plain tile
            continue
        rows.append(
            {
                "op": {"tt.load": "load", "tt.store": "store"}.get(
                    m.group(1), "async_copy"
                ),
                "shape": [int(v) for v in m.group(2).split("x")],
                "threads_per_warp": ints(layout, "threadsPerWarp"),
                "order": ints(layout, "order"),
            }
        )
    return rows


def linear_layouts(block=(16, 32, 64), num_warps: int = 4) -> list[dict]:
    """The global loads and stores of ``triton_modes._eqlin_fwd_kernel`` (strided
    loads, n_ang = 3, bf16, contiguous x and y: their mode stride is the constant 1
    the JIT specialises on), at a tile whose rows axis (``BLOCK_B``, the last axis of
    every tile of x and y) has a size of its own."""
    from ..linear import triton_modes

    tl = triton.language
    BB, BK, BO = block
    names = ("x_ptr", "w_ptr", "w_desc", "b_ptr", "y_ptr")
    types = {n: "*bf16" for n in names}  # no descriptor (W_DESC 0): w stands in
    const = dict(
        N_ANG=3, NA_PAD=4, HAS_BIAS=True, BLOCK_B=BB, BLOCK_K=BK, BLOCK_O=BO,
        PRECISION="ieee", UPCAST=False, ACC_DTYPE=tl.float32,
        PREFETCH=False, STORE3=False, W_DESC=0, JOIN=False,
        stride_x_m=1, stride_y_m=1, stride_w_k=1,
    )  # fmt: skip
    return memory_layouts(triton_modes._eqlin_fwd_kernel, types, const, num_warps)


def zonal_gather(L: int, C: int, block_e: int, warps: int) -> dict:
    """Resource usage of the zonal backward (edge gather) at one launch, fp32."""
    from .. import zonal

    k = zonal._zonal_gather_kernel
    types = {n: "*fp32" for n in k.arg_names if n.endswith("_ptr")}
    types.update(dst_ptr="*i64", scale_hi="fp32", scale_lo="fp32")
    const = {
        "L": L,
        "S_PAD": triton.next_power_of_2((L + 1) ** 2 - 1),
        "C_PAD": triton.next_power_of_2(C),
        "BLOCK_E": block_e,
        "ACC_DTYPE": triton.language.float32,
    }
    return resource_usage(k, types, const, warps)


def edge_frame_table(L: int = 2, C: int = 32, dtype: str = "fp32") -> list[dict]:
    """Resource usage of chapter 3's four kernels, table and packed, at the library's
    launch (``edge_frame.EdgeFrameLaunch()``), for sm_90."""
    from .. import edge_frame as ef
    from ..edge_frame import kernels as efk

    launch = ef.EdgeFrameLaunch()
    acc = triton.language.float64 if dtype == "fp64" else triton.language.float32
    base = {
        "L": L,
        "NA": L + 1,
        "NA_PAD": triton.next_power_of_2(L + 1),
        "C_PAD": triton.next_power_of_2(C),
        "ACC": acc,
    }
    S_PAD = triton.next_power_of_2((L + 1) ** 2)
    kernels = {
        "rotate_fwd": (efk._rotate_fwd_kernel, launch.rotate_block,
                       launch.rotate_warps, {"SIDE": 1, "PERM": True, "HAS_RHO": True}),
        "rotate_bwd": (efk._rotate_bwd_kernel, launch.rotate_bwd_block,
                       launch.rotate_bwd_warps, {"SIDE": 1, "PERM": True,
                                                 "HAS_RHO": True, "S_PAD": S_PAD}),
        "unrotate_fwd": (efk._unrotate_fwd_kernel, launch.unrotate_block,
                         launch.unrotate_warps, {"HAS_W": True, "S_PAD": S_PAD}),
        "unrotate_bwd": (efk._unrotate_bwd_kernel, launch.unrotate_bwd_block,
                         launch.unrotate_bwd_warps, {"HAS_W": True, "NEED_D": True,
                                                     "NEED_W": True}),
    }  # fmt: skip
    rows = []
    for name, (k, block, warps, extra) in kernels.items():
        for packed in (False, True):
            types = {n: f"*{dtype}" for n in k.arg_names if n.endswith("_ptr")}
            types.update(tab_ptr="*i32", ptr_ptr="*i64", perm_ptr="*i64")
            types.update(scale_hi="fp32", scale_lo="fp32")
            const = base | extra | {"BLOCK_E": block, "PACKED": packed}
            use = resource_usage(k, types, const, warps)
            rows.append(
                {
                    "kernel": name,
                    "variant": "packed" if packed else "table",
                    "dtype": dtype,
                    "L": L,
                    "C": C,
                    "block_e": block,
                    "warps": warps,
                    **use,
                }  # fmt: skip
            )
    return rows


#: The edge gather's launch in chapter 5's first capture: BLOCK_E 16
#: at every shape, 2 warps.
FIXED_LAUNCH = (16, 2)


def zonal_table(cases=None) -> list[dict]:
    """The zonal backward at the shapes of chapter 5's sweep: the fixed launch of the
    first capture against the one the tile rule and ``zonal.ZonalLaunch()`` give
    now."""
    from .. import zonal

    cases = cases or [(3, 32), (4, 32), (3, 64), (3, 100)]
    launch = zonal.ZonalLaunch()
    rows = []
    for L, C in cases:
        S_PAD = triton.next_power_of_2((L + 1) ** 2 - 1)
        C_PAD = triton.next_power_of_2(C)
        rule = zonal.edges_per_block(launch.bwd_tile, S_PAD, C_PAD)
        launches = (
            ("first capture: fixed BLOCK_E", *FIXED_LAUNCH),
            ("now: tile rule", rule, launch.bwd_warps),
        )
        for label, be, warps in launches:
            rows.append(
                {"L": L, "C": C, "launch": label, "block_e": be, "warps": warps}
                | zonal_gather(L, C, be, warps)
            )
    return rows


def zonal_variants(L: int = 3, C: int = 32, dtype: str = "fp64") -> list[dict]:
    """Both zonal kernels (the degrees forward and the edge gather), compiled for
    sm_90: in ``dtype`` at BLOCK_E 16, two stages of the CSR walk and one warp (the
    launch the interpreter type-checks less than the compiler: a kernel that only the
    interpreter ran may not compile), then in fp32 at the library's launch
    (``zonal.ZonalLaunch()``, the one the model runs)."""
    from .. import zonal

    tl = triton.language
    S_PAD = triton.next_power_of_2((L + 1) ** 2 - 1)
    C_PAD = triton.next_power_of_2(C)
    D = [triton.next_power_of_2(2 * l + 1) if l <= L else 1 for l in (1, 2, 3, 4)]
    degrees = dict(L=L, D1=D[0], D2=D[1], D3=D[2], D4=D[3], C_PAD=C_PAD)
    gather = dict(L=L, S_PAD=S_PAD, C_PAD=C_PAD)
    lib = zonal.ZonalLaunch()
    be_f = zonal.edges_per_block(lib.fwd_tile, zonal.fwd_rows(L), C_PAD)
    be_b = zonal.edges_per_block(lib.bwd_tile, S_PAD, C_PAD)
    fixed = "BLOCK_E 16, 2 stages, 1 warp"
    fixed_b = "BLOCK_E 16, 1 warp"
    library = (
        f"library: BLOCK_E {be_f}, {lib.fwd_stages} stages, {lib.fwd_warps} warp(s)"
    )
    cases = [  # (variant, kernel, constexprs, warps, dtype, launch)
        (
            "degrees",
            zonal._zonal_fwd_degrees_kernel,
            degrees | dict(BLOCK_E=16, STAGES=2),
            1,
            dtype,
            fixed,
        ),
        (
            "edge gather",
            zonal._zonal_gather_kernel,
            gather | dict(BLOCK_E=16),
            1,
            dtype,
            fixed_b,
        ),
        (
            "degrees",
            zonal._zonal_fwd_degrees_kernel,
            degrees | dict(BLOCK_E=be_f, STAGES=lib.fwd_stages),
            lib.fwd_warps,
            "fp32",
            library,
        ),
        (
            "edge gather",
            zonal._zonal_gather_kernel,
            gather | dict(BLOCK_E=be_b),
            lib.bwd_warps,
            "fp32",
            f"library: BLOCK_E {be_b}, {lib.bwd_warps} warp(s)",
        ),
    ]
    rows = []
    for label, kernel, const, warps, dt, launch in cases:
        acc = tl.float64 if dt == "fp64" else tl.float32
        types = {n: f"*{dt}" for n in kernel.arg_names if n.endswith("_ptr")}
        types.update(row_ptr_ptr="*i64", dst_ptr="*i64")
        types.update(scale_hi="fp32", scale_lo="fp32")
        rows.append(
            {"variant": label, "L": L, "C": C, "dtype": dt, "launch": launch}
            | resource_usage(kernel, types, const | {"ACC_DTYPE": acc}, warps)
        )
    return rows


def _sass_mix(compiled) -> dict:
    """Registers, spill stack and the static instruction mix of a compiled kernel:
    FMAs, shared-memory loads and stores, global loads (plain and asynchronous
    copies), barriers, spill traffic, and every instruction."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as fh:
            fh.write(compiled.asm["cubin"])
        tool = os.path.join(_tools_dir(), "cuobjdump")
        res = subprocess.run(
            [tool, "-res-usage", path], capture_output=True, text=True, check=True
        ).stdout
        sass = subprocess.run(
            [tool, "-sass", path], capture_output=True, text=True, check=True
        ).stdout
    shared = sorted(
        set(
            re.findall(
                r"#ttg\.swizzled_shared<\{vec = (\d+), perPhase = (\d+), "
                r"maxPhase = (\d+)",
                compiled.asm.get("ttgir", ""),
            )
        )
    )
    ops = re.findall(
        r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)", sass
    )
    first = [op.split(".")[0] for op in ops]

    def count(*names):
        return sum(first.count(n) for n in names)

    return {
        "registers": int(re.search(r"REG:(\d+)", res).group(1)),
        "stack_bytes": int(re.search(r"STACK:(\d+)", res).group(1)),
        "shared_bytes": int(compiled.metadata.shared),
        "ffma": count("FFMA"),
        "lds": count("LDS"),
        "sts": count("STS"),
        "ldg": count("LDG"),
        "ldgsts": count("LDGSTS"),
        "bar": count("BAR"),
        "spill": count("STL", "LDL"),
        "instructions": len(ops),
        "shared_layouts": "; ".join(
            "unswizzled" if (v, p, m) == ("1", "1", "1") else f"vec {v}, phases {m}"
            for v, p, m in shared
        )
        or "none in the TTGIR",
    }


def _dot_tile(ttgir: str, threads: int) -> str:
    """The register tile the compiler gave each thread for the first ``tt.dot``:
    ``"RxC (xN)"``, its layout's ``sizePerThread`` repeated N times over the tile."""
    m = re.search(r"tt\.dot .*?-> tensor<(\d+)x(\d+)xf32, (#\w+)>", ttgir)
    layout = re.search(rf"^{m.group(3)} = #ttg\.blocked<\{{(.*?)\}}>", ttgir, re.M)
    spt = [
        int(v)
        for v in re.search(r"sizePerThread = \[([0-9, ]*)\]", layout[1])[1].split(",")
    ]
    reps = int(m.group(1)) * int(m.group(2)) // (threads * spt[0] * spt[1])
    return f"{spt[0]}x{spt[1]} (x{reps})"


def _as_jit(kernel, args: dict, constexprs: dict):
    """Signature, constants and hints as the JIT gives them for these argument
    values: pointers (type strings) 16-byte aligned, integers equal to 1 made
    constants, integers divisible by 16 marked so (what vectorizes a load)."""
    sig, const, attrs = {}, dict(constexprs), {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        v = args.get(name, 2)
        if isinstance(v, str):
            sig[name] = v
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif v == 1:
            sig[name], const[name] = "constexpr", 1
        else:
            sig[name] = "i32"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, const, attrs


def linear_fp32(E: int = 47_000, F: int = 192) -> list[dict]:
    """Chapter 2's strict-fp32 forwards compiled for sm_90 at the model's shape (x, y
    ``(E, F, 3)`` contiguous, W ``(3, F, F)``): the Triton kernel at its launch
    (``linear.plan.LAUNCH["fp32"]``; Triton chose a 4 x 4 register tile, twice per
    program) and the Gluon FMA kernel (``linear.gluon_fma``) at each register tile,
    with and without its register cap."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from ..linear import gluon_fma, plan, triton_modes

    tl = triton.language
    ln = plan.LAUNCH["fp32"]
    names = ("x_ptr", "w_ptr", "w_desc", "b_ptr", "y_ptr")
    x = {n: "*fp32" for n in names}  # no descriptor (W_DESC 0): w stands in
    strides = dict(stride_x_b=3 * F, stride_x_k=3, stride_x_m=1)
    strides |= dict(stride_y_b=3 * F, stride_y_o=3, stride_y_m=1)
    strides |= dict(stride_w_m=F * F, stride_w_o=F, stride_w_k=1)
    const = dict(
        N_ANG=3, NA_PAD=4, HAS_BIAS=True, BLOCK_B=ln.block_b, BLOCK_K=ln.block_k,
        BLOCK_O=ln.block_o, PRECISION="ieee", UPCAST=False, ACC_DTYPE=tl.float32,
        PREFETCH=ln.prefetch, STORE3=ln.store3, W_DESC=0, JOIN=ln.join,
    )  # fmt: skip
    kernel = triton_modes._eqlin_fwd_kernel
    sig, c, attrs = _as_jit(kernel, x | strides | {"B": E, "K": F, "O": F}, const)
    src = ASTSource(fn=kernel, signature=sig, constexprs=c, attrs=attrs)
    opts = {"num_warps": ln.warps, "num_stages": ln.stages}
    compiled = triton.compile(src, target=GPUTarget(*H200), options=opts)
    rows = [
        {"kernel": "Triton (tl.dot on the FMA units)"}
        | {"tile": _dot_tile(compiled.asm["ttgir"], 32 * ln.warps)}
        | {"w": "K contiguous", "maxnreg": ""}
        | _sass_mix(compiled)
    ]
    k = gluon_fma._eqlin_fwd_fma_kernel
    for tile, (tm, tn, tr) in gluon_fma.TILES.items():
        for cap in (gluon_fma.FmaLaunch().maxnreg, None):
            args = {"x_ptr": "*fp32", "w_ptr": "*fp32", "b_ptr": "*fp32"}
            args |= {"y_ptr": "*fp32", "B": E, "K": F, "O": F, "stride_xb": 3 * F}
            args |= {"stride_wm": F * F, "stride_wk": F, "stride_yb": 3 * F}
            const = dict(
                HAS_BIAS=True, TM=tm, TN=tn, TR=tr, KS=4, EVEN_K=True,
                num_warps=gluon_fma.WARPS,
            )  # fmt: skip
            sig, c, attrs = _as_jit(k, args, const)
            src = GluonASTSource(fn=k, signature=sig, constexprs=c, attrs=attrs)
            opts = {"num_warps": gluon_fma.WARPS} | ({"maxnreg": cap} if cap else {})
            rows.append(
                {"kernel": "Gluon (FMA, ecekern.linear.gluon_fma)", "tile": tile}
                | {"w": "O contiguous", "maxnreg": cap or ""}
                | _sass_mix(triton.compile(src, target=GPUTarget(*H200), options=opts))
            )
    return rows


def linear_tc(
    cases=(("bf16", 64), ("bf16", 192), ("bf16", 256), ("fp32", 192)),
    O: int = 192,
) -> list[dict]:
    """``ecekern.linear.gluon_tc``'s forward compiled for sm_90 at the library's
    launch for each (dtype, K) of ``cases`` (``gluon_tc.default_launch``), with a
    bias: consumers, stages, registers, spill instructions, shared memory (the H200
    gives a program 227 KB) and the static instruction mix. The shared memory and the
    spills are what a change to the kernel or its launch table most easily breaks
    without a GPU to notice."""
    import torch
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from ..linear import gluon_tc

    rows = []
    for dt, K in cases:
        tdt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dt]
        gdt = {"bf16": gl.bfloat16, "fp32": gl.float32}[dt]
        bk, ln = gluon_tc.BLOCK_K[tdt], gluon_tc.default_launch(tdt, K)
        box = gl.NVMMASharedLayout.get_default_for([64, bk], gdt)
        desc = f"tensordesc<{dt}[64, {bk}],{box!r}>"
        args = {"x_desc": desc, "w_desc": desc, "p_ptr": f"*{dt}", "b_ptr": f"*{dt}"}
        args |= {"y_ptr": f"*{dt}", "B": 47_000, "O": O, "stride_yb": 3 * O}
        args |= {"n_rb": 735}
        const = dict(
            HAS_BIAS=True, BO=ln.block_o, NKB=K // bk, C=ln.consumers,
            STAGES=ln.stages, CONSUMER_REGS=ln.regs, num_warps=4,
        )  # fmt: skip
        kernel = gluon_tc._eqlin_fwd_tc_kernel
        sig, c, attrs = _as_jit(kernel, args, const)
        src = GluonASTSource(fn=kernel, signature=sig, constexprs=c, attrs=attrs)
        compiled = triton.compile(
            src, target=GPUTarget(*H200), options={"num_warps": 4}
        )
        mix = _sass_mix(compiled)
        mix.pop("shared_layouts")
        rows.append(
            {"dtype": dt, "K": K, "O": O, "consumers": ln.consumers}
            | {"stages": ln.stages, "regs_cap": ln.regs}
            | mix
        )
    return rows


def edge_layer_table(blocks=((64, 4), (32, 8))) -> list[dict]:
    """Chapter 8's forward and backward kernels at the book's widths (L = M = 2,
    C = 32, K = 2, fp32) in each precision: ``(block, warps)`` the stack products'
    output and inner block and the warps a program."""
    from triton.language import float32

    from ..edge_layer import BLOCK_E
    from ..edge_layer import kernels as K

    ints = ("E", "n_tiles", "C", "s_re", "s_rf", "s_de", "s_df")
    rows = []
    for (block, warps), prec, (name, k) in itertools.product(
        blocks, ("ieee", "tf32x3", "tf32", "bf16"),
        (("forward", K._edge_layer_fwd_kernel), ("backward", K._edge_layer_bwd_kernel)),
    ):  # fmt: skip
        types = {n: "*i64" if n in ("src", "dst") else "fp32" if n.startswith("scale")
                 else "*fp32" for n in k.arg_names if n not in ints}  # fmt: skip
        const = dict(L=2, NA=3, F=192, FO=96, K=2, HAS_BG=True, HAS_BO=True,
                     BE=BLOCK_E, BN=block, BK=block, BNO=32, CP=32, DT=float32,
                     PREC=prec)  # fmt: skip
        if name == "backward":
            const |= {"BKO": 32, "C2": 64}
        use = resource_usage(k, types, const, warps)
        rows.append({"kernel": name, "precision": prec, "block": block,
                     "warps": warps} | use)  # fmt: skip
    return rows


def main() -> int:
    if not available():
        print("needs Triton with its NVIDIA tools (Linux wheels)")
        return 1
    if sys.argv[1:] == ["--zonal-variants"]:
        print(json.dumps(zonal_variants()))
        return 0
    tables = {"--linear-fp32": linear_fp32, "--edge-layer": edge_layer_table}
    if sys.argv[1:2] and sys.argv[1] in tables:
        rows = tables[sys.argv[1]]()
        if len(sys.argv) > 2:  # a CSV for the book, each row with its provenance
            from .. import bench

            prov = bench.provenance(
                command=" ".join(["python -m", __spec__.name, *sys.argv[1:]])
            )
            prov["device"] = "none (offline sm_90 build)"
            bench.write_csv([r | prov for r in rows], sys.argv[2])
        print(json.dumps(rows))
        return 0
    if sys.argv[1:] == ["--linear-tc"]:
        print(json.dumps(linear_tc()))
        return 0
    if sys.argv[1:] == ["--linear-layouts"]:
        print(json.dumps(linear_layouts()))
        return 0
    print(json.dumps(zonal_table()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
