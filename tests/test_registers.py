"""The offline sm_90 builds of ``python -m ecekern.tools.registers`` (no GPU)."""

import json

import pytest


def _offline_sm90(*flags):
    """``python -m ecekern.tools.registers FLAGS`` as parsed JSON (see
    :func:`_offline_sm90_module`)."""
    return _offline_sm90_module("ecekern.tools.registers", *flags)


def _offline_sm90_module(module, *flags):
    """``python -m MODULE FLAGS`` as parsed JSON, in a process without the
    interpreter (which would replace the kernels by Python functions); skips where
    Triton's NVIDIA tools are missing."""
    return _offline_sm90_argv("-m", module, *flags)


def _offline_sm90_argv(*argv):
    """``python ARGV``'s output as parsed JSON, as :func:`_offline_sm90_module`."""
    import os
    import subprocess
    import sys

    from ecekern.tools import registers

    if not registers.available():
        pytest.skip("Triton's NVIDIA tools are not installed here")
    from ecekern._triton import GLUON_VALIDATED, triton

    if ".".join(triton.__version__.split(".")[:2]) not in GLUON_VALIDATED:
        # the builds' registers, layouts and instruction mix are facts of one release
        pytest.skip(f"offline builds are checked on Triton {GLUON_VALIDATED} only")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(p.stdout)


def test_register_report_compiles_for_sm90_without_a_gpu():
    """The offline resource report of chapter 5 (in a process without the
    interpreter, which would replace the kernels by Python functions)."""
    rows = _offline_sm90()
    assert {(r["L"], r["C"]) for r in rows} == {(3, 32), (4, 32), (3, 64), (3, 100)}
    for r in rows:
        assert 0 < r["registers"] <= 255 and r["stack_bytes"] >= 0
    by = {(r["L"], r["C"], r["launch"]): r for r in rows}
    # the tile rule never gives a larger per-thread stack than the fixed launch
    for L, C in ((4, 32), (3, 64), (3, 100)):
        fixed = by[(L, C, "first capture: fixed BLOCK_E")]
        assert by[(L, C, "now: tile rule")]["stack_bytes"] <= fixed["stack_bytes"]


def test_every_zonal_kernel_compiles_for_sm90():
    """Both zonal kernels compile for the H200, in fp64 at a fixed launch and in fp32
    at the library's (the interpreter does not check what the compiler does: that
    both returns of a jit function have one shape, say; and the forward's per-degree
    helpers take tuples of arguments)."""
    rows = _offline_sm90("--zonal-variants")
    assert [(r["variant"], r["dtype"]) for r in rows] == [
        ("degrees", "fp64"),
        ("edge gather", "fp64"),
        ("degrees", "fp32"),
        ("edge gather", "fp32"),
    ]
    assert all(0 < r["registers"] <= 255 for r in rows)
    assert all(r["launch"].startswith("library") for r in rows[2:])


def test_linear_tiles_put_a_warp_on_the_features_not_the_rows():
    """Chapter 2's bug, held: with rows first, Triton's coalescing gave a warp's 32
    threads to 32 rows (one sector per element). Compiled for sm_90, every tile of x
    and y of the forward must give the rows axis (BLOCK_B = 16) no lanes and the
    feature axis all 32. (The rows-first kernels of b7b3dea give the rows 16.)"""
    layouts = _offline_sm90("--linear-layouts")
    tiles = [r for r in layouts if 16 in r["shape"]]  # x and y, not W
    assert {r["op"] for r in tiles} >= {"store"} and len(tiles) >= 6
    for r in tiles:
        rows = r["shape"].index(16)
        assert r["threads_per_warp"][rows] == 1, r
        assert r["threads_per_warp"][1 - rows] == 32, r


def test_linear_fp32_kernels_build_for_sm90():
    """The strict-fp32 forwards (the Triton kernel at ``plan.LAUNCH["fp32"]`` and the
    Gluon FMA kernel at each tile, capped and not) compile for sm_90 with their
    instruction mix; uncapped, the FMA kernel keeps every value in registers."""
    pytest.importorskip("triton.experimental.gluon")
    rows = _offline_sm90("--linear-fp32")
    assert rows[0]["kernel"].startswith("Triton") and rows[0]["ffma"] > 0
    fma = rows[1:]
    assert {(r["tile"], r["maxnreg"]) for r in fma} == {
        ("8x4", 168), ("8x4", ""), ("4x8", 168), ("4x8", "")
    }  # fmt: skip
    for r in fma:
        assert r["ffma"] == 1536 and 0 < r["registers"] <= 255
        if r["maxnreg"] == "":
            assert r["spill"] == 0 and r["stack_bytes"] == 0, r


def test_linear_tc_builds_fit_the_h200_and_bf16_does_not_spill():
    """gluon_tc's forward at the library's launch, compiled for sm_90 with a bias:
    every build fits the 227 KB of shared memory a program may have, and the bf16
    builds (the ones the library dispatches) keep every value in registers. (Adding
    the bias in the accumulators' layout from global memory once spilled 108
    instructions; two rings of two stages at K = 256 spilled 38: the launch table
    gives that K one consumer.)"""
    pytest.importorskip("triton.experimental.gluon")
    rows = _offline_sm90("--linear-tc")
    assert {(r["dtype"], r["K"]) for r in rows} == {
        ("bf16", 64), ("bf16", 192), ("bf16", 256), ("fp32", 192)
    }  # fmt: skip
    for r in rows:
        assert 0 < r["shared_bytes"] <= 227 * 1024, r
        if r["dtype"] == "bf16":
            assert r["spill"] == 0 and r["stack_bytes"] == 0, r
    by = {(r["dtype"], r["K"]): r for r in rows}
    assert by[("bf16", 192)]["consumers"] == 2 and by[("bf16", 256)]["consumers"] == 1


def test_chapter_7s_kernels_build_for_sm90():
    """The radial kernels at n_rbf = 8, H = 64, O = 448 in every dtype and
    precision: shared memory within sm_90's 227 KB per program (Triton's default
    three pipeline stages needed 256 KB for the 3xTF32 backward, which then failed
    to launch); the launch is untuned, and the backward spills 0.4-1.2 KB a
    thread. The geometry kernels for every (L, M): no spills."""
    rows = _offline_sm90_module("ecekern.tools.step_kernels")
    assert len(rows["radial"]) == 8
    for r in rows["radial"]:
        assert r["shared_bytes"] <= 227 * 1024, r
        assert 0 < r["registers"] <= 255, r
    assert len(rows["geometry"]) == 20
    for r in rows["geometry"]:
        assert r["stack_bytes"] == 0 and 0 < r["registers"] <= 255, r


_LINEAR_X_PRODUCTS = """
import json
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ecekern._triton import triton
from ecekern.linear import triton_modes
from ecekern.tools.registers import H200, _as_jit
E, F = 3_000_000, 192  # m = 2 times the mode stride 2 E F passes 2^31
args = {n: "*fp32" for n in ("x_ptr", "w_ptr", "w_desc", "b_ptr", "y_ptr")} | dict(
    B=E, K=F, O=F, stride_x_b=F, stride_x_k=1, stride_x_m=2 * E * F,
    stride_w_m=F * F, stride_w_o=F, stride_w_k=1, stride_y_b=3 * F, stride_y_o=3,
    stride_y_m=1)
const = dict(N_ANG=3, NA_PAD=4, HAS_BIAS=True, BLOCK_B=64, BLOCK_K=32, BLOCK_O=64,
             PRECISION="ieee", UPCAST=False, ACC_DTYPE=triton.language.float32,
             PREFETCH=False, STORE3=False, W_DESC=0, JOIN=False)
k = triton_modes._eqlin_fwd_kernel
sig, c, attrs = _as_jit(k, args, const)
src = ASTSource(fn=k, signature=sig, constexprs=c, attrs=attrs)
ttir = triton.compile(src, target=GPUTarget(*H200)).asm["ttir"]
print(json.dumps([line.split(" loc(")[0].strip() for line in ttir.splitlines()
                  if "arith.muli" in line and "%stride_x" in line]))
"""


def test_linear_offsets_of_a_planes_view_are_int64():
    """The linears take x of any strides; a planes pair's rows ``(E, F, n_ang)`` have
    the mode stride ``2 E F``, an int32 below 5.6M edges at F = 192, and m = 2 times
    it passes 2^31 from 2.8M edges: the Triton kernel multiplies x's strides in int64
    (read from its sm_90 TTIR: the interpreter cannot hold such a tensor)."""
    products = _offline_sm90_argv("-c", _LINEAR_X_PRODUCTS)
    assert products, "no product of x's strides in the TTIR"
    for line in products:
        assert line.endswith(": i64"), line
