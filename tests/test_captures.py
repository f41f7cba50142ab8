import csv
import json

import pytest

from ecekern import captures

INTERPRET = __import__("ecekern._triton")._triton.INTERPRET


def test_committed_captures_load_and_have_provenance():
    for chapter in ("methodology", "01_reference", "05_zonal"):
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
    assert all(r["step_ms"] > 0 for r in rows)
    assert all(r["system"] == r["chapter"] for r in rows)
    for r in rows:  # the reference's own ratio is 1
        if r["system"] in ("reference", "1. einsum reference"):
            assert r["vs_reference"] == pytest.approx(1.0)
    if "progress.csv" in captures.load("01_reference").files():
        order = [captures.PROGRESS_ROWS.index(r["system"]) for r in rows]
        keys = [(r["n_atoms"], r["dtype"] != "float32", i) for r, i in zip(rows, order)]
        assert keys == sorted(keys)
        return
    assert any(r["chapter"].startswith("1.") for r in rows)
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


def _write_progress(folder, rows):
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({"chapter": "01_reference"}))
    keys = ["system", "n_atoms", "n_edges", "dtype", "step_ms", "peak_mem_MiB"]
    keys += ["device", "commit", "error"]
    with (folder / "progress.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in keys})


def test_progress_rows_read_the_progress_table(tmp_path):
    """With chapter 1's progress.csv, the table is that file's rows (failed ones left
    out) in the table's order, each with its speed-up over the reference and over
    the fastest peer at the same size and precision."""

    def row(system, n, dtype, ms):
        return dict(
            system=system, n_atoms=n, n_edges=10 * n, dtype=dtype, step_ms=ms,
            peak_mem_MiB=100.0, device="NVIDIA H200", commit="abc",
        )  # fmt: skip

    rows = [
        row("library defaults", 512, "float32", 20.0),
        row("e3nn TP conv (NequIP-style)", 512, "float32", 30.0),
        row("reference", 512, "float32", 40.0),
        row("reference + torch.compile", 512, "float32", 25.0),
        row("reference", 512, "float32+tf32", 32.0),
        row("library defaults", 512, "float32+tf32", 16.0),
        row("reference", 4096, "float32", 230.0),
        dict(system="+ ch2 linear", n_atoms=4096, dtype="float32", error="OOM"),
    ]
    _write_progress(tmp_path / "01_reference", rows)
    got = captures.progress_rows(tmp_path)
    assert [(r["n_atoms"], r["dtype"], r["system"]) for r in got] == [
        (512, "float32", "reference"),
        (512, "float32", "library defaults"),
        (512, "float32", "reference + torch.compile"),
        (512, "float32", "e3nn TP conv (NequIP-style)"),
        (512, "float32+tf32", "reference"),
        (512, "float32+tf32", "library defaults"),
        (4096, "float32", "reference"),
    ]
    by = {(r["n_atoms"], r["dtype"], r["system"]): r for r in got}
    defaults = by[(512, "float32", "library defaults")]
    assert defaults["vs_reference"] == pytest.approx(2.0)
    assert defaults["vs_fastest_peer"] == pytest.approx(25.0 / 20.0)
    assert by[(512, "float32+tf32", "library defaults")]["vs_fastest_peer"] is None
    assert by[(4096, "float32", "reference")]["vs_reference"] == pytest.approx(1.0)
    assert defaults["chapter"] == "library defaults"


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
    # a row an interrupted capture left without a value names the gap, not a crash
    md = captures.markdown_table([{"a": None}], {"a": "A"}, {"a": "{:.1f}"})
    assert md.splitlines()[-1] == "| not captured |"


def test_load_errors_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="manifest"):
        captures.load("nope", root=tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"chapter": "x"}))
    (tmp_path / "t.csv").write_text("n,v\n1,2.5\n3,abc\n")
    cap = captures.load("x", root=tmp_path)
    assert cap.csv("t") == [{"n": 1, "v": 2.5}, {"n": 3, "v": "abc"}]


def test_registry_is_keyed_by_the_chapter_slugs():
    from ecekern.captures import chapters

    slugs = {"methodology", "01_reference", "02_linear", "03_edge_frame",
             "04_graph_step", "05_zonal", "06_cohorts"}  # fmt: skip
    assert set(chapters.REGISTRY) == slugs
    book = captures.capture_root().parent
    for slug in chapters.REGISTRY:  # a chapter in the book has its captures
        if (book / f"{slug}.ipynb").is_file():
            assert (captures.capture_root() / slug / "manifest.json").is_file()


@pytest.fixture
def quick_timing(monkeypatch):
    """bench.time_fn with no warm-up and one timed call: the CPU smoke tests."""
    from ecekern import bench

    real = bench.time_fn
    monkeypatch.setattr(
        bench, "time_fn", lambda fn, **kw: real(fn, warmup_ms=0, rep_ms=0, min_reps=1)
    )


def _rows(path):
    return list(csv.DictReader(path.open()))


@pytest.mark.skipif(not INTERPRET, reason="CPU smoke test")
@pytest.mark.parametrize("chapter", ["02_linear", "05_zonal"])
def test_chapter_sweeps_run_as_a_smoke_test_on_the_cpu(chapter, tmp_path, quick_timing):
    """The GPU sweeps, at tiny sizes in the interpreter: every row is written and every
    fast path agrees with float64 (the same rows, on the H200, lift the CUDA gates);
    the launch sweep times its launches and reports the fastest per group."""
    from ecekern.captures import chapters

    info = chapters.REGISTRY[chapter](tmp_path, quick=True, ncu=False)
    assert sorted(p.name for p in tmp_path.glob("*.csv")) == (
        ["launch_sweep.csv", "linear_sweep.csv"]
        if chapter == "02_linear"
        else ["launch_sweep.csv", "scatter_sweep.csv"]
    )
    sweep = "linear_sweep" if chapter == "02_linear" else "scatter_sweep"
    rows = _rows(tmp_path / f"{sweep}.csv")
    assert all("error" not in r or not r["error"] for r in rows)
    key = "path" if chapter.startswith("02") else "op"
    assert {r[key] for r in rows} == (
        {"einsum", "dense", "triton"} if key == "path" else {"reference", "fused"}
    )
    for r in rows:
        tol = 2e-2 if r["dtype"].startswith("bfloat16") else 1e-5
        assert float(r["rel_err_vs_fp64"]) < tol, r
        assert float(r["forward_ms"]) > 0 and float(r["floor_ms"]) > 0
    launch = _rows(tmp_path / "launch_sweep.csv")
    assert launch and all(not r.get("error") for r in launch)
    assert all(float(r["time_ms"]) > 0 for r in launch)
    if chapter == "02_linear":  # the Triton kernel's launches in each precision
        assert {r["dtype"] for r in launch} == {"float32", "float32+tf32", "bfloat16"}
        assert set(info["launch"]) == {"float32", "float32+tf32", "bfloat16"}
        assert set(info["launch_json"]["float32"]) >= {"kernel", "block_b", "stages"}
    else:  # the forward's and the gather's launches, one ZonalLaunch chosen
        assert {r["kind"] for r in launch} == {"forward", "backward"}
        assert info["launch"].startswith("degrees tile=")
        assert info["model_steps"] == "skipped: no GPU"


def test_launch_sweep_keeps_the_fastest_correct_launch_per_group(tmp_path):
    """The one launch sweep of chapters 2 and 5: a case that raised is a row with its
    error, a wrong result is a row but never chosen, and the fastest correct case of
    each group is returned."""
    import time

    from ecekern.captures.common import LaunchCase, launch_sweep

    def case(group, name, delay, err=0.0, fail=False):
        keys = {"variant": name}
        return LaunchCase(group, (delay, err, fail), keys, columns={"E": 1})

    cases = [
        case("a", "slow", 0.004),
        case("a", "fast", 0.0),
        case("a", "wrong", 0.0, err=1.0),
        case("b", "raises", 0.0, fail=True),
        case("b", "only", 0.002),
    ]

    def run(c):
        delay, err, fail = c.launch
        if fail:
            raise RuntimeError("out of resources")
        time.sleep(delay)
        return err

    from ecekern import bench

    def host_time(fn):  # the cases sleep on the host: no CUDA graph can replay that
        return bench.time_fn(fn, warmup_ms=1, rep_ms=20, device="cpu")

    best = launch_sweep(
        cases, run, lambda c, out: out, tmp_path / "sweep.csv", timer=host_time
    )
    assert {g: c.keys["variant"] for g, c in best.items()} == {"a": "fast", "b": "only"}
    rows = _rows(tmp_path / "sweep.csv")
    assert [r["variant"] for r in rows] == ["slow", "fast", "wrong", "raises", "only"]
    assert "out of resources" in rows[3]["error"] and not rows[3]["time_ms"]
    assert rows[0]["E"] == "1" and float(rows[0]["time_ms"]) >= 4.0


def test_launches_go_to_nsight_compute_as_json():
    from ecekern import zonal
    from ecekern.captures.common import launch_from_json, launch_to_json
    from ecekern.linear import gluon_fma, gluon_tc, triton_modes

    for kernel, launch in (
        ("triton", triton_modes.TritonLaunch(32, 16, 32, 4, 1, prefetch=True)),
        ("fma", gluon_fma.FmaLaunch("4x8", None)),
        ("tc", gluon_tc.Launch(64, 2, 2, 216)),
        ("zonal", zonal.ZonalLaunch(fwd_stages=3)),
    ):
        d = json.loads(json.dumps(launch_to_json(kernel, launch)))
        assert launch_from_json(d) == (kernel, launch)


def test_stage_times_attribute_the_backward_to_the_stages(float64_default):
    """The backward's autograd nodes go to the stage whose forward made them (by the
    profiler's sequence numbers): every stage with a backward gets time, and the
    stages add up to what the profile saw."""
    from torch.profiler import ProfilerActivity, profile

    import ecekern
    from ecekern import options
    from ecekern.captures.stages import OUTSIDE, cpu_us, stage_times
    from ecekern.model import force_step, prepare_inputs

    cfg = ecekern.ECEConfig(lmax=1, channels=4, n_gated=1, cutoff=3.0)
    model = ecekern.ECEModel(cfg)
    inputs = prepare_inputs(ecekern.systems.diamond(1), cfg.cutoff)
    with options.use(reference=True):
        force_step(model, *inputs)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            force_step(model, *inputs)
    events = prof.events()
    times = stage_times(events, cpu_us)
    assert list(times)[:3] == ["geometry", "edge_frames", "gie"]
    assert list(times)[-1] == OUTSIDE
    for stage in ("geometry", "gie", "rotate_and_select", "mixing_stack", "aggregate"):
        fwd, bwd = times[stage]
        assert fwd > 0 and bwd > 0, (stage, fwd, bwd)
    assert times["readout"][0] > 0
    top = [e for e in events if e.cpu_parent is None]
    total_ms = sum(e.cpu_time_total for e in top) / 1e3
    counted = sum(f + b for f, b in times.values())
    assert counted == pytest.approx(total_ms, rel=1e-6)


@pytest.mark.skipif(not INTERPRET, reason="CPU smoke test")
def test_progress_part_runs_as_a_smoke_test_on_the_cpu(tmp_path, quick_timing):
    """Chapter 1's progress part on a tiny model and box: every eager row in the
    table's order, both precisions, the stages of the reference and the defaults;
    with no time left the compiled rows are skipped and say so, and the loader reads
    the table back with its ratios."""
    import ecekern
    from ecekern.captures import progress

    cfg = ecekern.ECEConfig(
        lmax=1, channels=8, n_gated=1, n_interactions=1, cutoff=2.0,
        radial_hidden=8, readout_hidden=8,
    )  # fmt: skip
    out = tmp_path / "01_reference"
    out.mkdir()
    info = progress.capture(out, [1], budget_s=0, dev="cpu", config=cfg)
    rows = _rows(out / "progress.csv")
    ours = list(progress.OURS)
    labels = [r["system"] for r in rows]
    peers = ["e3nn TP conv (NequIP-style)"]
    assert (
        labels == [*ours, *peers] * 2
        or labels
        == [
            *ours,
            *peers,
            "cuEquivariance TP conv (NequIP-style)",
        ]
        * 2
    )
    assert [r["dtype"] for r in rows] == ["float32"] * (len(rows) // 2) + [
        "float32+tf32"
    ] * (len(rows) // 2)
    fused = {label for label, p in progress.CH6_STACKS if p.endswith("-stack")}
    for r in rows:
        assert r["n_atoms"] == "8"
        if r["system"] in fused and r.get("error"):  # no Gluon on this machine: the
            assert "FallbackWarning" in r["error"]  # row says so, and has no time
            continue
        assert not r.get("error") and float(r["step_ms"]) > 0 and int(r["reps"]) >= 1
    ref = rows[0]
    assert ref["options"].startswith("Options(reference=True")
    assert rows[1]["zonal"] == "reference" and rows[1]["edge_frame"] == "reference"
    assert rows[2]["zonal"] == "reference" and rows[2]["edge_frame"] == "packed"
    assert rows[3]["zonal"] == "reference" and rows[3]["mode"] == "replay"
    assert rows[4]["zonal"] == "fused" and rows[4]["edge_frame"] == "packed"
    assert rows[4]["mode"] == "replay" and rows[5]["mode"] == "replay"
    assert rows[5]["cohorts"] == "True" and rows[4]["cohorts"] == "False"
    for i, (label, _) in enumerate(progress.CH6_STACKS, start=6):
        assert rows[i]["system"] == label
        assert rows[i]["mode"] == "replay" or label in fused and rows[i]["error"]
    n = 6 + len(progress.CH6_STACKS)
    assert rows[n]["system"] == "library defaults" and rows[n]["mode"] == "eager"
    assert info["library_defaults"] == repr(ecekern.options.current())
    for label in progress.COMPILED:
        assert info[f"progress: {label}, 8 atoms, fp32"].startswith("skipped")
    stages = _rows(out / "stages.csv")
    assert {r["system"] for r in stages} == {"reference", "library defaults"}
    assert {"mixing_stack", "gie", "aggregate"} <= {r["stage"] for r in stages}
    (out / "manifest.json").write_text(json.dumps({"chapter": "01_reference"}))
    table = captures.progress_rows(tmp_path)
    assert [r["system"] for r in table] == [r["system"] for r in rows
                                            if not r.get("error")]  # fmt: skip
    assert table[0]["vs_reference"] == pytest.approx(1.0)
    assert all(r["vs_fastest_peer"] > 0 for r in table)


def test_parts_are_parsed_and_unknown_parts_rejected():
    from ecekern.captures.common import parse_parts

    known = ("launch", "steps", "sweep")
    assert parse_parts("launch,steps=dense;einsum", known) == {
        "launch": "",
        "steps": "dense;einsum",
    }
    with pytest.raises(ValueError, match="unknown part"):
        parse_parts("launch,sweeps", known)


def test_sweep_cells_name_their_precisions():
    from ecekern.captures.linear import sweep_cell

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


def test_a_part_run_merges_into_the_chapter_manifest(tmp_path, monkeypatch):
    """``--parts`` re-runs part of a chapter: the earlier notes stay, this run's
    replace theirs, and the run is listed under ``runs`` with its provenance."""
    import torch

    from ecekern import bench
    from ecekern.captures import __main__ as cli
    from ecekern.captures import chapters

    def chapter(out, quick=False, ncu=True, parts="a,b"):
        (out / f"{parts}.csv").write_text("x\n1\n")
        return {p: f"done {p}" for p in parts.split(",")}

    monkeypatch.setitem(chapters.REGISTRY, "methodology", chapter)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "provenance", lambda **kw: {"command": kw["command"]})
    read = lambda: json.loads((tmp_path / "methodology" / "manifest.json").read_text())  # noqa: E731
    assert cli.main(["methodology", "--out", str(tmp_path)]) == 0
    first = read()
    assert first["a"] == "done a" and "runs" not in first
    assert cli.main(["methodology", "--out", str(tmp_path), "--parts", "b"]) == 0
    m = read()
    assert m["a"] == "done a" and m["b"] == "done b"
    assert m["provenance"] == first["provenance"]  # the full run's stays on top
    assert m["files"] == ["a,b.csv", "b.csv"]
    assert [r["parts"] for r in m["runs"]] == ["b"]
    assert m["runs"][0]["provenance"]["command"].endswith("--parts b")


def test_chapter_opening_reads_its_row_and_stage_share():
    """A chapter opens with its progress-table row and its stages' share of the
    reference's force step, both from the one-run capture."""
    from ecekern import captures

    text = captures.chapter_opening("+ ch5 zonal", ("gie",))
    assert "`gie` takes" in text and "x vs fastest peer" in text
    assert text.count("\n| 4096 |") == 2  # strict fp32 and TF32
    assert "takes" not in captures.chapter_opening("reference", ())


@pytest.mark.skipif(not INTERPRET, reason="CPU smoke test")
def test_graph_step_capture_runs_as_a_smoke_test_on_the_cpu(tmp_path):
    """Chapter 4's unpack and audit parts at a tiny size: the boolean-mask unpack
    equals the library's and is caught synchronising; the step's audit is empty."""
    from ecekern.captures import chapters

    info = chapters.REGISTRY["04_graph_step"](tmp_path, quick=True, ncu=False)
    assert info["steps"] == "skipped: no GPU"
    rows = {r["unpack"]: r for r in _rows(tmp_path / "unpack.csv")}
    assert int(rows["masked"]["syncs"]) >= 3
    assert int(rows["indexed"]["syncs"]) == 0 == int(rows["indexed"]["h2d"])
    audit = _rows(tmp_path / "audit.csv")
    assert [r["kind"] for r in audit] == ["none"]
    assert info["audit"] == {"defaults: syncs, h2d": [0, 0],
                             "reference: syncs, h2d": [0, 0]}  # fmt: skip


@pytest.mark.skipif(not INTERPRET, reason="CPU smoke test")
def test_cohorts_capture_runs_as_a_smoke_test_on_the_cpu(tmp_path):
    """Chapter 6's stack part at a tiny size; the step parts need a GPU."""
    from ecekern.captures import chapters, cohorts

    info = chapters.REGISTRY["06_cohorts"](tmp_path, quick=True, ncu=False)
    assert info["steps"] == "skipped: no GPU" and info["memory"] == "skipped: no GPU"
    assert info["precision"] == "skipped: no GPU" and info["ncu"] == "skipped: no GPU"
    rows = _rows(tmp_path / "stack.csv")
    labels = [c[0] for c in cohorts.COHORTS] + [f[0] for f in cohorts.FUSED]
    labels.append(cohorts.FUSED_RECOMPUTE[0])
    labels += [f[0] for f in cohorts.STACK_RECOMPUTE]
    assert [r["stack"] for r in rows] == labels
    assert all("multiples of 16" in r["note"] for r in rows[len(cohorts.COHORTS) :])
