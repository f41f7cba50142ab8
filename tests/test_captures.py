import json

import pytest

from ecekern import captures


def test_committed_captures_load_and_have_provenance():
    for chapter in ("methodology", "01_einsum_reference", "05_fused_scatter"):
        cap = captures.load(chapter)
        prov = cap.manifest["provenance"]
        assert prov["device"] and prov["commit"] and prov["date"]
        assert cap.manifest["status"] == "ok"
        for name in cap.manifest["files"]:
            assert name in cap.files()


def test_ceilings_are_plausible_for_the_h200():
    rows = captures.load("methodology").csv("ceilings")
    kinds = {r["kind"] for r in rows}
    assert {"copy", "elementwise", "gemm"} <= kinds
    for r in rows:
        assert r["device"] == "NVIDIA H200" and r["median_ms"] > 0
        assert r["p10_ms"] <= r["median_ms"] <= r["p90_ms"]


def test_progress_rows_come_from_the_chapter_captures():
    rows = captures.progress_rows()
    assert {r["n_atoms"] for r in rows} == {512, 4096}
    assert any(r["chapter"].startswith("1.") for r in rows)
    assert all(r["step_ms"] > 0 for r in rows)
    assert rows == sorted(
        rows,
        key=lambda r: (
            r["n_atoms"],
            r["dtype"] != "float32",
            not r["chapter"][0].isdigit(),
        ),
    )
    # a TF32 row is only shown beside the reference's TF32 step at the same size
    for r in rows:
        if r["dtype"] != "float32":
            assert any(
                x["chapter"].startswith("1.") and x["dtype"] == r["dtype"]
                for x in rows
                if x["n_atoms"] == r["n_atoms"]
            )


def test_ncu_pages_parse():
    cap = captures.load("methodology")
    (k,) = captures.ncu_kernels(cap, "ncu_copy")
    assert "neg" in k["kernel"] and k["time_ms"] > 0 and 0 < k["dram_pct"] <= 100
    assert k["dram_MB"] > 1000  # a 1 GiB read plus a 1 GiB write
    assert "stall_long_scoreboard" in k


def test_markdown_table():
    md = captures.markdown_table(
        [{"a": 1.25, "b": "x"}], {"a": "A", "b": "B"}, {"a": "{:.1f}"}
    )
    assert md.splitlines() == ["| A | B |", "|---|---|", "| 1.2 | x |"]


def test_load_errors_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="manifest"):
        captures.load("nope", root=tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"chapter": "x"}))
    (tmp_path / "t.csv").write_text("n,v\n1,2.5\n3,abc\n")
    cap = captures.load("x", root=tmp_path)
    assert cap.csv("t") == [{"n": 1, "v": 2.5}, {"n": 3, "v": "abc"}]


@pytest.mark.skipif(
    not __import__("ecekern.linear").linear.INTERPRET, reason="CPU smoke test"
)
@pytest.mark.parametrize("chapter", ["02_block_diagonal_gemm", "05_fused_scatter"])
def test_chapter_sweeps_run_as_a_smoke_test_on_the_cpu(chapter, tmp_path, monkeypatch):
    """The GPU sweeps, at tiny sizes in the interpreter: every row is written and every
    fast path agrees with float64 (the same rows, on the H200, lift the CUDA gates)."""
    import csv

    from ecekern import bench
    from ecekern.captures import chapters

    real = bench.time_fn
    monkeypatch.setattr(
        bench, "time_fn", lambda fn, **kw: real(fn, warmup_ms=0, rep_ms=0, min_reps=1)
    )
    info = chapters.REGISTRY[chapter](tmp_path, quick=True, ncu=False)
    info = {k: v for k, v in info.items() if k not in ("parts", "config")}
    assert info in ({}, {"model_steps": "skipped: no GPU"})
    (csv_path,) = tmp_path.glob("*.csv")
    rows = list(csv.DictReader(csv_path.open()))
    assert all("error" not in r or not r["error"] for r in rows)
    key = "path" if chapter.startswith("02") else "op"
    assert {r[key] for r in rows} == (
        {"einsum", "dense", "triton"} if key == "path" else {"reference", "fused"}
    )
    for r in rows:
        tol = 2e-2 if r["dtype"].startswith("bfloat16") else 1e-5
        assert float(r["rel_err_vs_fp64"]) < tol, r
        assert float(r["forward_ms"]) > 0 and float(r["floor_ms"]) > 0


def test_parts_are_parsed_and_unknown_parts_rejected():
    from ecekern.captures.chapters import parse_parts

    known = ("launch", "steps", "sweep")
    assert parse_parts("launch,steps=dense;einsum", known) == {
        "launch": "",
        "steps": "dense;einsum",
    }
    with pytest.raises(ValueError, match="unknown part"):
        parse_parts("launch,sweeps", known)


def test_sweep_cells_name_their_precisions():
    from ecekern.captures.chapters import sweep_cell

    p = {"fp32": 0, "tf32": 1, "bf16": 2}
    every = ["einsum", "dense", "triton"]
    assert sweep_cell("365000:5", p) == (365000, 5, ["fp32", "tf32", "bf16"], every)
    assert sweep_cell("47000:3:tf32/bf16", p) == (47000, 3, ["tf32", "bf16"], every)
    assert sweep_cell("47000:3:all:triton", p) == (
        47000,
        3,
        ["fp32", "tf32", "bf16"],
        ["triton"],
    )
    assert sweep_cell("47000:2:bf16:dense/triton", p)[3] == ["dense", "triton"]
    for bad in ("47000:3:fp16", "47000:3:tf32:bf16", "47000:3:all:triton:x"):
        with pytest.raises(ValueError, match="sweep cell"):
            sweep_cell(bad, p)


def _offline_sm90(*flags):
    """``python -m ecekern.captures.registers FLAGS`` as parsed JSON, in a process
    without the interpreter (which would replace the kernels by Python functions);
    skips where Triton's NVIDIA tools are missing."""
    import json
    import os
    import subprocess
    import sys

    from ecekern.captures import registers

    if not registers.available():
        pytest.skip("Triton's NVIDIA tools are not installed here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run(
        [sys.executable, "-m", "ecekern.captures.registers", *flags],
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


def test_every_zonal_kernel_variant_compiles_for_sm90():
    """Every launch variant zonal.CONFIG can select compiles for the H200 (the
    per-block sums variant once failed there only: the interpreter does not check
    that both returns of a jit function have one shape)."""
    rows = _offline_sm90("--zonal-variants")
    assert len(rows) == 5
    assert all(0 < r["registers"] <= 255 for r in rows)


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


def test_linear_tc_builds_fit_the_h200_and_bf16_does_not_spill():
    """linear_tc's forward at the library's launch, compiled for sm_90 with a bias:
    every build fits the 227 KB of shared memory a program may have, and the bf16
    builds (the ones the library dispatches) keep every value in registers. (Adding
    the bias in the accumulators' layout from global memory once spilled 108
    instructions; two rings of two stages at K = 256 spilled 38: the launch table
    gives that K one consumer.)"""
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


def test_a_capture_stopped_by_sigterm_keeps_its_rows(tmp_path, monkeypatch):
    """``timeout`` sends SIGTERM: the manifest says so and the rows written so far
    are listed and archived (a device call's time limit must not lose them)."""
    import os
    import signal
    import tarfile

    import torch

    from ecekern import bench
    from ecekern.captures import __main__ as cli
    from ecekern.captures import chapters

    def chapter(out, quick=False, ncu=True):
        (out / "rows.csv").write_text("a\n1\n")
        try:  # inside a sweep's per-cell handler: the stop must not be swallowed
            os.kill(os.getpid(), signal.SIGTERM)
            sum(range(10**6))  # the handler runs between bytecodes
        except Exception:
            (out / "swallowed.csv").write_text("")
        raise AssertionError("not reached")

    monkeypatch.setitem(chapters.REGISTRY, "methodology", chapter)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "provenance", lambda **kw: {"command": "test"})
    before = signal.getsignal(signal.SIGTERM)
    try:
        rc = cli.main(["methodology", "--out", str(tmp_path)])
    finally:
        signal.signal(signal.SIGTERM, before)
    manifest = json.loads((tmp_path / "methodology" / "manifest.json").read_text())
    assert rc == 1 and manifest["status"] == "interrupted"
    assert manifest["files"] == ["rows.csv"]
    with tarfile.open(tmp_path / "captures.tar.gz") as tar:
        assert "methodology/rows.csv" in tar.getnames()
