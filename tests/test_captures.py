import csv
import json

import pytest

from ecekern import captures
from ecekern.captures import runner, schema

INTERPRET = __import__("ecekern._triton")._triton.INTERPRET
ROOT = captures.capture_root()
#: The committed step-timing CSVs (step schema) and kernel-timing CSVs (kernel schema).
STEP_CSVS = ("force_step", "peers", "scaling", "progress", "model_steps", "steps")
KERNEL_CSVS = ("ceilings", "stack", "launch_sweep", "launch_sweep_4", "kernels",
               "linear_sweep", "scatter_sweep")  # fmt: skip


def _header(path):
    with path.open(newline="") as fh:
        return next(csv.reader(fh))


def _rows(path):
    return list(csv.DictReader(path.open()))


def test_committed_captures_load_and_have_provenance():
    """Every chapter in the book has stored captures, and every stored capture
    loads with its provenance."""
    for chapter in runner.CHAPTERS:
        in_book = (ROOT.parent / f"{chapter}.ipynb").is_file()
        if not in_book and not (ROOT / chapter).is_dir():
            continue  # a chapter whose notebook and captures are still to come
        cap = captures.load(chapter)
        prov = cap.manifest["provenance"]
        assert prov["device"] and prov["commit"] and prov["date"]
        # rows kept either way; a partial run names the parts that failed
        status = cap.manifest["status"]
        assert status in ("ok", "interrupted", "partial")
        if status == "partial":
            failed = [k for k, v in cap.manifest.items()
                      if isinstance(v, str) and v.startswith("failed")]  # fmt: skip
            assert failed, chapter
        for name in cap.manifest["files"]:
            assert name in cap.files()


def test_every_step_csv_has_the_step_schema():
    """Every committed step timing: the schema's columns first, in order, then the
    chapter's own, ``provenance`` last; ``mode`` eager or replay; a JSON provenance."""
    found = [p for p in ROOT.glob("*/*.csv") if p.stem in STEP_CSVS]
    assert len(found) >= 9
    for path in found:
        head = _header(path)
        cols = schema.STEP_COLUMNS
        assert head[: len(cols) - 1] == list(cols[:-1]) and head[-1] == cols[-1], path
        rows = captures.load(path.parent.name).csv(path.stem)
        schema.check(rows)
        for r in rows:
            assert r["provenance"]["device"].startswith(("NVIDIA H100", "NVIDIA H200"))
            assert r.get("error") or r["p10"] <= r["ms"] <= r["p90"], (path, r)
            assert r.get("error") or r["peak_MiB"] > 0
            assert r["reps"] == "" or r["reps"] >= 1  # chapter 4's did not count
    for path in (p for p in ROOT.glob("*/*.csv") if p.stem in KERNEL_CSVS):
        head = _header(path)
        assert head[: len(schema.KERNEL_COLUMNS) - 1] == list(
            schema.KERNEL_COLUMNS[:-1]
        )
        rows = captures.load(path.parent.name).csv(path.stem)
        schema.check(rows, schema.KERNEL_COLUMNS)
        for r in rows:
            assert r["provenance"]["device"].startswith(("NVIDIA H100", "NVIDIA H200"))
            assert r.get("error") or (r["n"] > 0 and r["ms"] > 0), (path, r)
            if r["p10"] != "":  # a row that failed, or timed by its median alone
                assert r["p10"] <= r["ms"] <= r["p90"], (path, r)


def test_no_capture_names_peak_memory_twice():
    for path in ROOT.glob("*/*.csv"):
        assert "peak_mem_MiB" not in _header(path), path


def test_schema_rows_are_checked_and_written_in_order(tmp_path):
    from ecekern.bench import Timing

    t = Timing(2.0, 1.5, 3.0, 7)
    plan = schema.plan({"linear": "dense", "zonal": "reference"})
    assert plan == "linear=dense,zonal=reference" and schema.plan({}) == ""
    row = schema.step_row("dense", 8, 40, "replay", "float32", plan, t, 2**21, kind="x")
    assert (row["ms"], row["p10"], row["p90"], row["reps"]) == (2.0, 1.5, 3.0, 7)
    assert row["peak_MiB"] == 2.0 and json.loads(row["provenance"])["torch"]
    path = schema.write([row], tmp_path / "steps.csv")
    assert _header(path) == [*schema.STEP_COLUMNS[:-1], "kind", "provenance"]
    with pytest.raises(ValueError, match="mode"):
        schema.step_row("dense", 8, 40, "graph", "float32", plan, t, 0)
    with pytest.raises(ValueError, match="mode"):
        schema.write([{**row, "mode": "graph"}], tmp_path / "bad.csv")
    with pytest.raises(ValueError, match=r"lacks \['peak_MiB'\]"):
        schema.check([{k: v for k, v in row.items() if k != "peak_MiB"}])
    k = schema.kernel_row("copy", "1 MiB", 2**18, "float32", t, nbytes=4e6, flops=2e9)
    assert k["GBps"] == pytest.approx(2.0) and k["TFLOPs"] == pytest.approx(1.0)
    schema.check([k], schema.KERNEL_COLUMNS)


def test_ceilings_are_plausible_for_the_h200():
    rows = captures.load("methodology").csv("ceilings")
    assert {"copy", "elementwise", "gemm"} <= {r["kernel"] for r in rows}
    for r in rows:
        assert r["provenance"]["device"] == "NVIDIA H200" and r["ms"] > 0
        assert r["p10"] <= r["ms"] <= r["p90"]
        rate = r["TFLOPs"] if r["kernel"] == "gemm" else r["GBps"]
        assert rate > (10 if r["kernel"] == "gemm" else 1000)


def test_progress_rows_come_from_the_progress_table():
    rows = captures.progress_rows()
    assert {r["n_atoms"] for r in rows} == {512, 4096}
    assert all(r["step_ms"] > 0 for r in rows)
    assert all(r["system"] == r["chapter"] for r in rows)
    for r in rows:  # the reference's own ratio is 1
        if r["system"] == "reference":
            assert r["vs_reference"] == pytest.approx(1.0)
    order = [captures.PROGRESS_ROWS.index(r["system"]) for r in rows]
    keys = [(r["n_atoms"], r["dtype"] != "float32", i) for r, i in zip(rows, order)]
    assert keys == sorted(keys)


def test_progress_rows_read_the_progress_table(tmp_path):
    """The table is progress.csv's rows (failed ones left out) in the table's order,
    each with its speed-up over the reference and over the fastest peer at the same
    size and precision."""
    from ecekern.bench import Timing

    def row(system, n, precision, ms):
        t = Timing(ms, ms, ms, 5)
        return schema.step_row(system, n, 10 * n, "eager", precision, "", t, 2**20)

    def replay(system, ms):
        return row(system, 512, "float32", ms) | {"mode": "replay"}

    rows = [
        replay("library defaults", 10.0),
        replay("e3nn TP conv (NequIP-style)", 20.0),
        row("library defaults", 512, "float32", 20.0),
        row("e3nn TP conv (NequIP-style)", 512, "float32", 30.0),
        row("reference", 512, "float32", 40.0),
        row("reference + torch.compile", 512, "float32", 25.0),
        row("reference", 512, "float32+tf32", 32.0),
        row("library defaults", 512, "float32+tf32", 16.0),
        row("reference", 4096, "float32", 230.0),
        schema.step_row(
            "+ ch2 linear", 4096, 1, "eager", "float32", "", None, None, error="OOM"
        ),  # fmt: skip
    ]
    (tmp_path / "01_reference").mkdir()
    (tmp_path / "01_reference" / "manifest.json").write_text("{}")
    schema.write(rows, tmp_path / "01_reference" / "progress.csv")
    got = captures.progress_rows(tmp_path)
    assert [(r["n_atoms"], r["dtype"], r["system"]) for r in got] == [
        (512, "float32", "reference"),
        (512, "float32", "library defaults"),  # replay before eager
        (512, "float32", "library defaults"),
        (512, "float32", "reference + torch.compile"),
        (512, "float32", "e3nn TP conv (NequIP-style)"),
        (512, "float32", "e3nn TP conv (NequIP-style)"),
        (512, "float32+tf32", "reference"),
        (512, "float32+tf32", "library defaults"),
        (4096, "float32", "reference"),
    ]
    assert [r["mode"] for r in got[1:3]] == ["replay", "eager"]
    # a replayed row against the eager reference (the only one) says so; its peers
    # are the replayed ones only
    assert got[1]["vs_reference"] == pytest.approx(4.0)
    assert got[1]["reference_mode"] == "eager"
    assert got[1]["vs_fastest_peer"] == pytest.approx(2.0)
    # FLOP: ours by the model of the run's config where the run has none, a peer's
    # not invented
    from ecekern import ECEConfig
    from ecekern.flops import step_flops

    assert got[1]["flop"] == step_flops(ECEConfig(), 512, 5120)["total"]
    assert got[1]["flop_source"] == "model" and got[4]["flop"] is None
    by = {(r["n_atoms"], r["dtype"], r["system"], r["mode"]): r for r in got}
    defaults = by[(512, "float32", "library defaults", "eager")]
    assert defaults["vs_reference"] == pytest.approx(2.0)
    assert defaults["vs_fastest_peer"] == pytest.approx(25.0 / 20.0)
    tf32 = by[(512, "float32+tf32", "library defaults", "eager")]
    assert tf32["vs_fastest_peer"] is None
    assert by[(4096, "float32", "reference", "eager")]["vs_reference"] == 1.0
    assert defaults["chapter"] == "library defaults" and defaults["peak_MiB"] == 1


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
    (tmp_path / "t.csv").write_text('n,v,provenance\n1,2.5,"{""commit"": ""0123""}"\n')
    cap = captures.load("x", root=tmp_path)
    assert cap.csv("t") == [{"n": 1, "v": 2.5, "provenance": {"commit": "0123"}}]


def test_every_chapter_is_a_module_of_parts():
    """The runner's chapters by slug: each module has its parts (callables), its
    GPU-only parts among them and a default that parses; a chapter in the book has
    its captures."""
    slugs = {"methodology", "01_reference", "02_linear", "03_edge_frame",
             "04_graph_step", "05_zonal", "06_cohorts", "07_step",
             "08_edge_layer", "A_train"}  # fmt: skip
    assert set(runner.CHAPTERS) == slugs
    for slug in runner.CHAPTERS:
        mod = runner.chapter_module(slug)
        assert mod.PARTS and all(callable(f) for f in mod.PARTS.values())
        assert set(getattr(mod, "GPU_ONLY", ())) <= set(mod.PARTS)
        runner.parse_parts(getattr(mod, "DEFAULT", ",".join(mod.PARTS)), mod.PARTS)
        if (ROOT.parent / f"{slug}.ipynb").is_file():
            assert (ROOT / slug / "manifest.json").is_file()
    with pytest.raises(ValueError, match="unknown chapter"):
        runner.chapter_module("07_nope")


def test_parts_are_parsed_and_unknown_parts_rejected():
    known = ("launch", "steps", "sweep")
    assert runner.parse_parts("launch,steps=dense;einsum", known) == {
        "launch": "",
        "steps": "dense;einsum",
    }
    with pytest.raises(ValueError, match="unknown part"):
        runner.parse_parts("launch,sweeps", known)


@pytest.fixture
def toy_chapter(monkeypatch):
    """A chapter module of two parts, ``a`` and ``b`` (its note: a dict merged into
    the manifest), and one that needs a GPU; each writes ``<part>.csv``."""
    import sys
    import types

    import torch

    from ecekern import bench

    mod = types.ModuleType("ecekern.captures._toy")

    def part(name, note):
        def run(r, arg):
            (r.out / f"{name}.csv").write_text("x\n1\n")
            return note

        return run

    mod.PARTS = {"a": part("a", "done a"), "b": part("b", {"b": "done b", "n": 1}),
                 "gpu": part("gpu", None)}  # fmt: skip
    mod.DEFAULT = "a,b,gpu"
    mod.GPU_ONLY = ("gpu",)
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setitem(runner.CHAPTERS, "methodology", "_toy")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(bench, "provenance", lambda **kw: {"command": kw["command"]})
    return mod


def test_a_part_run_merges_into_the_chapter_manifest(tmp_path, toy_chapter):
    """The runner: without a GPU it says so (``--cpu`` runs what needs none); a
    ``--parts`` run keeps the earlier notes, replaces theirs and is listed under
    ``runs`` with its provenance; everything is archived."""
    import tarfile

    read = lambda: json.loads((tmp_path / "methodology" / "manifest.json").read_text())  # noqa: E731
    assert runner.main(["methodology", "--out", str(tmp_path)]) == 2
    assert runner.main(["methodology", "--out", str(tmp_path), "--cpu"]) == 0
    first = read()
    assert first["a"] == "done a" and first["b"] == "done b" and first["n"] == 1
    assert first["gpu"] == "skipped: no GPU" and "runs" not in first
    assert first["files"] == ["a.csv", "b.csv"] and first["status"] == "ok"
    args = ["methodology", "--out", str(tmp_path), "--cpu", "--parts", "b"]
    toy_chapter.PARTS["b"] = lambda r, arg: {"b": "again"}
    assert runner.main(args) == 0
    m = read()
    assert m["a"] == "done a" and m["b"] == "again"
    assert m["provenance"] == first["provenance"]  # the full run's stays on top
    assert [r["parts"] for r in m["runs"]] == ["b"]
    assert m["runs"][0]["provenance"]["command"].endswith("--parts b")
    with tarfile.open(tmp_path / "captures.tar.gz") as tar:
        assert "methodology/a.csv" in tar.getnames()
    toy_chapter.PARTS["b"] = lambda r, arg: 1 / 0  # a part that fails says so
    assert runner.main(args) == 1 and read()["b"].startswith("failed: ZeroDivision")
    assert read()["runs"][-1]["status"] == "partial"


def test_a_capture_stopped_by_sigterm_keeps_its_rows(tmp_path, toy_chapter):
    """``timeout`` sends SIGTERM: the manifest says so and the rows written so far
    are listed and archived (a device call's time limit must not lose them)."""
    import os
    import signal
    import tarfile

    def stopped(r, arg):
        (r.out / "rows.csv").write_text("a\n1\n")
        try:  # inside a sweep's per-cell handler: the stop must not be swallowed
            os.kill(os.getpid(), signal.SIGTERM)
            sum(range(10**6))  # the handler runs between bytecodes
        except Exception:
            (r.out / "swallowed.csv").write_text("")
        raise AssertionError("not reached")

    toy_chapter.PARTS = {"a": stopped}
    toy_chapter.DEFAULT = "a"
    before = signal.getsignal(signal.SIGTERM)
    try:
        rc = runner.main(["methodology", "--out", str(tmp_path), "--cpu"])
    finally:
        signal.signal(signal.SIGTERM, before)
    manifest = json.loads((tmp_path / "methodology" / "manifest.json").read_text())
    assert rc == 1 and manifest["status"] == "interrupted"
    assert manifest["files"] == ["rows.csv"]
    with tarfile.open(tmp_path / "captures.tar.gz") as tar:
        assert "methodology/rows.csv" in tar.getnames()


@pytest.fixture
def quick_timing(monkeypatch):
    """bench.time_fn with no warm-up and one timed call: the CPU smoke tests."""
    from ecekern import bench

    real = bench.time_fn
    monkeypatch.setattr(
        bench, "time_fn", lambda fn, **kw: real(fn, warmup_ms=0, rep_ms=0, min_reps=1)
    )


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
    assert list(times)[:4] == ["geometry", "edge_frames", "radial", "gie"]
    assert list(times)[-1] == OUTSIDE
    for stage in ("geometry", "radial", "gie", "rotate_and_select", "mixing_stack",
                  "aggregate"):  # fmt: skip
        fwd, bwd = times[stage]
        assert fwd > 0 and bwd > 0, (stage, fwd, bwd)
    assert times["readout"][0] > 0
    top = [e for e in events if e.cpu_parent is None]
    total_ms = sum(e.cpu_time_total for e in top) / 1e3
    counted = sum(f + b for f, b in times.values())
    assert counted == pytest.approx(total_ms, rel=1e-6)


def test_chapter_opening_reads_its_row_and_stage_share():
    """A chapter opens with its progress-table row and its stages' share of the
    reference's force step, both from the one-run capture."""
    from ecekern import captures

    text = captures.chapter_opening("+ ch5 zonal", ("gie",))
    assert "`gie` takes" in text and "x vs fastest peer" in text
    mine = [r for r in captures.progress_rows()
            if (r["system"], r["n_atoms"]) == ("+ ch5 zonal", 4096)]  # fmt: skip
    assert {r["dtype"] for r in mine} == {"float32", "float32+tf32"}
    assert text.count("\n| 4096 |") == len(mine)  # each precision, each mode run
    assert "takes" not in captures.chapter_opening("reference", ())


@pytest.mark.slow  # every row of the table, replays too: minutes in the interpreter
@pytest.mark.skipif(not INTERPRET, reason="CPU smoke test")
def test_progress_part_runs_as_a_smoke_test_on_the_cpu(tmp_path, quick_timing):
    """Chapter 1's progress part on a tiny model and box: every eager row in the
    table's order and the step schema, both precisions, each row's plan the paths
    its options resolved to, the stages of the reference and the defaults; with no
    time left the compiled rows are skipped and say so, and the loader reads the
    table back with its ratios."""
    import ecekern
    from ecekern.captures import progress
    from ecekern.flops import step_flops

    cfg = ecekern.ECEConfig(
        lmax=1, channels=8, n_gated=1, n_interactions=1, cutoff=2.0,
        radial_hidden=8, readout_hidden=8,
    )  # fmt: skip
    out = tmp_path / "01_reference"
    out.mkdir()
    info = progress.capture(out, [1], budget_s=0, dev="cpu", config=cfg)
    rows = _rows(out / "progress.csv")
    ours, peers = list(progress.OURS), ["e3nn TP conv (NequIP-style)"]
    cueq = ["cuEquivariance TP conv (NequIP-style)"]
    # each label replayed, then eager (the table's order)
    labels = [(r["system"], r["mode"]) for r in rows]
    one = [(label, m) for label in ours + peers for m in ("replay", "eager")]
    with_cueq = [
        (label, m) for label in ours + peers + cueq for m in ("replay", "eager")
    ]
    assert labels in (one * 2, with_cueq * 2)
    half = len(rows) // 2
    assert [r["precision"] for r in rows] == ["float32"] * half + [
        "float32+tf32"
    ] * half
    fused = {label for label, p in progress.CH6_STACKS if p["stack"] == "fused"}
    flop = {r["flop"] for r in rows if r["system"] in ours}
    assert flop == {str(step_flops(cfg, 8, int(rows[0]["n_edges"]))["total"])}
    assert {r["flop_source"] for r in rows if r["system"] in peers} == {"counted"}
    for r in rows:
        assert r["n_atoms"] == "8"
        if r["system"] in peers + cueq and r["mode"] == "replay":  # no CUDA graphs
            assert "CUDA graphs need" in r["error"] and not r["ms"]
            assert any("replay" in k and "failed" in v for k, v in info.items())
            continue
        if r["system"] in fused and r.get("error"):  # no Gluon on this machine: the
            assert "FallbackWarning" in r["error"]  # row says so, and has no time
            continue
        assert not r.get("error") and float(r["ms"]) > 0 and int(r["reps"]) >= 1
    plan = {r["system"]: dict(p.split("=") for p in r["plan"].split(","))
            for r in rows[: 2 * len(ours)]}  # fmt: skip
    assert plan["reference"]["linear"] == "einsum"
    assert plan["+ ch2 linear"]["edge_frame"] == "reference"
    assert plan["+ ch3 edge_frame"]["edge_frame"] == "packed"
    assert plan["+ ch4 graph_step"]["zonal"] == "reference"
    assert plan["+ ch5 zonal"]["zonal"] == "fused"
    assert plan["+ ch6 cohorts"]["memory"] == "keep"
    assert plan["+ ch5 zonal"]["memory"] == "plain"
    assert all(r["plan"] == "" for r in rows if r["system"] in peers + cueq)
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
    # no replayed peer on a CPU: the eager rows have a peer in their mode
    assert all(r["vs_fastest_peer"] > 0 for r in table if r["mode"] == "eager")


@pytest.mark.skipif(not INTERPRET, reason="CPU smoke test")
def test_graph_step_capture_runs_as_a_smoke_test_on_the_cpu(tmp_path):
    """Chapter 4's audit part at a tiny size, through the command line (``--quick
    --cpu``): the step's audit is empty; the manifest says so and the archive holds
    the rows."""
    import tarfile

    args = ["04_graph_step", "--out", str(tmp_path), "--quick", "--cpu"]
    assert runner.main(args) == 0
    with tarfile.open(tmp_path / "captures.tar.gz") as tar:
        assert "04_graph_step/audit.csv" in tar.getnames()
    tmp_path = tmp_path / "04_graph_step"
    info = json.loads((tmp_path / "manifest.json").read_text())
    assert info["status"] == "ok" and info["steps"] == "skipped: no GPU"
    audit = _rows(tmp_path / "audit.csv")
    assert [r["kind"] for r in audit] == ["none"]
    assert info["audit"] == {"defaults: syncs, h2d": [0, 0],
                             "reference: syncs, h2d": [0, 0]}  # fmt: skip


def test_ncu_part_runs_the_named_programs(tmp_path, monkeypatch):
    """One Nsight Compute part for every chapter: each name is a program and a CSV,
    ``ncu=NAME`` picks some, and an unknown name is an error."""
    from ecekern.captures import common

    calls = []

    def fake(target, out_csv, extra, timeout):
        calls.append((target, out_csv.name, extra, timeout))
        return "ok"

    monkeypatch.setattr(common, "run_ncu", fake)
    part = common.ncu_part(
        {"a": ("prog_a", ["-k", "x"]), "b": ("prog_b", None)}, timeout=9
    )
    run = runner.Run(tmp_path)
    assert part(run, "") == {"ncu_a": "ok", "ncu_b": "ok"}
    assert calls == [("prog_a", "ncu_a.csv", ["-k", "x"], 9),
                     ("prog_b", "ncu_b.csv", None, 9)]  # fmt: skip
    assert part(run, "b") == {"ncu_b": "ok"}
    with pytest.raises(ValueError, match="choose from a, b"):
        part(run, "c")


@pytest.mark.skipif(not INTERPRET, reason="CPU smoke test")
def test_option_steps_time_each_case_in_each_mode(tmp_path, quick_timing):
    """The one "steps under these option dicts" part: a row per mode and case, in
    that order, each under its options and TF32 (switched off after), the hook run
    under them and free to add columns."""
    import ecekern
    from ecekern.captures import common

    cfg = ecekern.ECEConfig(lmax=1, channels=4, n_gated=1, n_interactions=1,
                            cutoff=2.0, radial_hidden=8, readout_hidden=8)  # fmt: skip
    seen = []

    def each(rep, model, inputs, row, kw):
        tf32 = __import__("torch").backends.cuda.matmul.allow_tf32
        seen.append((rep, row["system"], tf32, kw))
        row["hook"] = len(seen)

    cases = [("a", {"reference": True}, {"tf32": True, "kind": "x"}),
             ("b", {"linear": "einsum"}, {"kind": "y"})]  # fmt: skip
    run = runner.Run(tmp_path, quick=True, dev="cpu")
    common.option_steps(run, cases, "steps", cfg, modes=schema.MODES, each=each)
    rows = _rows(tmp_path / "steps.csv")
    assert [(r["system"], r["mode"]) for r in rows] == [
        ("a", "eager"), ("b", "eager"), ("a", "replay"), ("b", "replay")]  # fmt: skip
    assert [r["precision"] for r in rows] == ["float32+tf32", "float32"] * 2
    assert [r["plan"] for r in rows[:2]] == ["reference=True", "linear=einsum"]
    assert [r["kind"] for r in rows] == ["x", "y"] * 2 and rows[3]["hook"] == "4"
    assert seen[0] == (1, "a", True, {"kind": "x"}) and seen[1][2] is False
    assert not __import__("torch").backends.cuda.matmul.allow_tf32
    for r in rows:  # a replay's graph: its headroom, edge slots and capture time
        replay = r["mode"] == "replay"
        assert (r["capacity"] != "") == replay and (r["capture_s"] != "") == replay
        assert not replay or int(r["capacity"]) >= int(r["n_edges"])
    # a replay's arguments and the columns measured on its step after the timing
    from ecekern.model import prepare_inputs

    atoms, f32 = ecekern.systems.diamond(1), __import__("torch").float32
    inputs = prepare_inputs(atoms, cfg.cutoff, f32, "cpu")
    model = ecekern.ECEModel(cfg)
    row = common.force_row("c", model, inputs, mode="replay",
                           graph_kw={"headroom": 1.5},
                           more=lambda fn: {"calls": fn() is not None})  # fmt: skip
    assert row["headroom"] == 1.5 and row["calls"] is True
    assert row["capacity"] >= 1.5 * row["n_edges"]


@pytest.mark.skipif(not INTERPRET, reason="CPU smoke test")
def test_the_waterfall_adds_up_to_the_replayed_step(tmp_path):
    """Chapter 7's waterfall (a smoke run in the interpreter): per case the stages
    of the model, the rest outside them and the launch gaps add up to the step, each
    stage with its cost and floor; the step's floor is the stages' floors summed."""
    import ecekern
    from ecekern.captures import step
    from ecekern.captures.stages import OUTSIDE
    from ecekern.flops import STAGES

    cfg = ecekern.ECEConfig(lmax=1, channels=4, n_gated=1, n_interactions=1,
                            cutoff=2.0, radial_hidden=8, readout_hidden=8)  # fmt: skip
    run = runner.Run(tmp_path, quick=True, dev="cpu")
    step.waterfall(run, cfg=cfg)
    rows = _rows(tmp_path / "waterfall.csv")
    assert {r["variant"] for r in rows} == set(step.WATERFALL)
    shown = [s for s in STAGES if s not in step.FOLDED]
    for variant in step.WATERFALL:
        case = {r["stage"]: r for r in rows if r["variant"] == variant}
        assert list(case) == [*shown, OUTSIDE, step.GAPS, step.STEP]
        parts = sum(float(case[s]["ms"]) for s in [*shown, OUTSIDE, step.GAPS])
        assert parts == pytest.approx(float(case[step.STEP]["ms"]), rel=1e-9)
        for s in shown:
            r = case[s]
            assert float(r["ms"]) == pytest.approx(
                float(r["forward_ms"]) + float(r["backward_ms"])
            )
            assert int(r["bytes"]) > 0 and float(r["floor_ms"]) > 0
        floors = sum(float(case[s]["floor_ms"]) for s in shown)
        assert float(case[step.STEP]["floor_ms"]) == pytest.approx(floors)


@pytest.mark.skipif(not INTERPRET, reason="CPU smoke test")
def test_the_md_part_reports_throughput_and_drift(tmp_path):
    """Chapter 7's MD capture (a smoke run in the interpreter): ASE and TorchSim
    rows with steps per second, ns/day at 1 fs and atom-steps per second that agree
    with each other, and a batch of small systems counted by all its atoms."""
    pytest.importorskip("torch_sim")  # not in `make newest`'s venv
    from ecekern.captures import step

    step.md(runner.Run(tmp_path, quick=True, dev="cpu"))
    rows = _rows(tmp_path / "md.csv")
    assert [(r["host"], r["n_systems"]) for r in rows] == [
        ("ASE eager", "1"), ("TorchSim", "1"), ("TorchSim", "2")]  # fmt: skip
    for r in rows:
        per_s, n = float(r["steps_per_s"]), int(r["n_atoms"]) * int(r["n_systems"])
        assert int(r["steps"]) >= 5 and per_s > 0
        assert float(r["ns_per_day"]) == pytest.approx(per_s * 86400e-6)
        assert float(r["atom_steps_per_s"]) == pytest.approx(per_s * n)
        assert float(r["ms_per_step"]) == pytest.approx(1e3 / per_s)
        assert abs(float(r["drift_meV_atom_ps"])) < 1e3


@pytest.mark.slow  # a capture part in the interpreter: half a minute
@pytest.mark.skipif(not INTERPRET, reason="CPU smoke test")
def test_the_whole_step_precision_part_compares_with_float64(tmp_path):
    """Chapter 7's precision part (a smoke run in the interpreter, the default case
    only): force and energy errors against float64 with the same weights, small and
    positive; an NVE row per case, float64's included, with its drift."""
    import ecekern
    from ecekern.captures import step

    cfg = ecekern.ECEConfig(lmax=1, channels=4, n_gated=1, n_interactions=1,
                            cutoff=2.0, radial_hidden=8, readout_hidden=8)  # fmt: skip
    step.precision(runner.Run(tmp_path, quick=True, dev="cpu"), cfg=cfg)
    rows = _rows(tmp_path / "precision.csv")
    assert [float(r["rattle_A"]) for r in rows] == list(step.RATTLES)
    for r in rows:
        assert r["precision"] == step.STEP_PRECISIONS[0][0]
        assert 0 < float(r["rms_force_err_rel"]) <= float(r["max_force_err_rel"]) < 1e-4
        assert float(r["energy_err_per_atom_eV"]) < 1e-5
    nve = _rows(tmp_path / "nve.csv")
    assert [r["precision"] for r in nve] == ["fp64", step.STEP_PRECISIONS[0][0]]
    assert all(abs(float(r["drift_meV_per_atom_ps"])) < 10 for r in nve)


@pytest.mark.slow  # a capture part in the interpreter: half a minute
@pytest.mark.skipif(not INTERPRET, reason="CPU smoke test")
def test_the_scale_part_grows_the_box_per_memory_strategy(tmp_path):
    """Chapter 7's scale part (a smoke run in the interpreter): per memory strategy,
    its box (one, 8 atoms) with its time per atom-step and the allocator setting."""
    import ecekern
    from ecekern.captures import step

    cfg = ecekern.ECEConfig(lmax=1, channels=4, n_gated=1, n_interactions=1,
                            cutoff=2.0, radial_hidden=8, readout_hidden=8)  # fmt: skip
    step.scale(runner.Run(tmp_path, quick=True, dev="cpu"), cfg=cfg)
    rows = _rows(tmp_path / "scale.csv")
    assert [(r["memory"], int(r["n_atoms"])) for r in rows] == [
        (m, 8) for m in step.SCALE_MEMORY]  # fmt: skip
    for r in rows:
        per = 1e3 * float(r["ms"]) / int(r["n_atoms"])
        assert float(r["us_per_atom_step"]) == pytest.approx(per)
        assert r["mode"] == "replay" and "alloc_conf" in r


@pytest.mark.slow  # two model steps in the interpreter: half a minute
@pytest.mark.skipif(not INTERPRET, reason="CPU smoke test")
def test_the_edge_layer_steps_part_compares_the_two_plans(tmp_path):
    """Chapter 8's steps part (a smoke run in the interpreter): the layer kernels'
    and the fused edge layer's step, each row naming its plan."""
    from ecekern.captures import edge_layer

    edge_layer.PARTS["steps"](runner.Run(tmp_path, quick=True, dev="cpu"), "")
    rows = _rows(tmp_path / "steps.csv")
    plans = ["precision=3xtf32,stack=layers", "precision=3xtf32,edge_layer=triton"]
    assert [r["plan"] for r in rows] == plans
    assert all(float(r["ms"]) > 0 and r["mode"] == "eager" for r in rows)


def test_the_training_step_part_runs_on_the_cpu(tmp_path):
    """The training appendix's step part (a smoke run on the CPU, a small model on
    four structures of the shipped carbon set): the defaults' and the reference's
    training step, timed, in the step schema."""
    from ecekern.captures import train

    train.PARTS["step"](runner.Run(tmp_path, quick=True, dev="cpu"), "")
    rows = _rows(tmp_path / "train_steps.csv")
    assert [r["plan"] for r in rows] == ["defaults", "reference"]
    assert all(float(r["ms"]) > 0 and int(r["n_atoms"]) > 0 for r in rows)


def test_the_model_checks_part_runs_on_the_cpu(tmp_path):
    """The appendix's checks part on a saved small model: the equation of state,
    the Gamma-point frequencies (3 per atom of the 8-atom cell) and the NVE rows at
    three time steps; without a checkpoint it says what it needs."""
    from ecekern import ECEConfig, ECEModel
    from ecekern.captures import train

    run = runner.Run(tmp_path, quick=True, dev="cpu")
    assert train.PARTS["checks"](run, "").startswith("skipped")
    model = ECEModel(ECEConfig(species=(6,), **train.SMOKE))
    model.save(tmp_path / "m.pt")
    assert train.PARTS["checks"](run, str(tmp_path / "m.pt")) == "done"
    out = json.loads((tmp_path / "model_checks.json").read_text())
    assert len(out["gamma_THz"]) == 24 and len(out["eos"]["energies"]) == 7
    assert [r["dt_fs"] for r in out["nve"]] == [0.25, 0.5, 1.0]
