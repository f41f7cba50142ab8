"""The offline sm_90 builds of ``python -m ecekern.tools.registers`` (no GPU)."""

import json

import pytest


def _offline_sm90(*flags):
    """``python -m ecekern.tools.registers FLAGS`` as parsed JSON, in a process
    without the interpreter (which would replace the kernels by Python functions);
    skips where Triton's NVIDIA tools are missing."""
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
        [sys.executable, "-m", "ecekern.tools.registers", *flags],
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


def test_the_radial_kernels_fit_sm90_at_the_books_widths():
    """Chapter 7's radial kernels at n_rbf = 8, H = 64, O = 448 in every dtype and
    precision: shared memory within sm_90's 227 KB per program (Triton's default
    three pipeline stages needed 256 KB for the 3xTF32 backward, which then failed
    to launch). The launch is untuned: the backward spills (0.4-1.2 KB a thread)."""
    rows = _offline_sm90("--radial")
    assert len(rows) == 8
    for r in rows:
        assert r["shared_bytes"] <= 227 * 1024, r
        assert 0 < r["registers"] <= 255, r
