"""The options and the step plan: dispatch decided once, options scoped per thread."""

import threading

import pytest
import torch

import ecekern
from ecekern import options, plan
from ecekern.options import Options

SHAPES = plan.Shapes(lmax=2, mmax=2, channels=32, n_gated=2)  # the book's model
TINY = ecekern.ECEConfig(channels=2, radial_hidden=4, readout_hidden=2, n_gated=1)


def resolve(device="cuda", dtype=torch.float32, tf32=False, shapes=SHAPES, **opts):
    cap = (9, 0) if device == "cuda" else None
    return plan.resolve(device, cap, dtype, tf32, shapes, Options(**opts))


def test_every_field_defaults_to_auto_and_rejects_unknown_values():
    o = Options()
    assert o.reference is False and o.cohort_edges == "auto"
    assert all(getattr(o, name) == "auto" for name in options.CHOICES)
    for name, bad in [("precision", "fp16"), ("stack", "tf32x3-stack"),
                      ("memory", "cohorts"), ("linear", "fast"),
                      ("zonal", "on"), ("edge_frame", None)]:  # fmt: skip
        with pytest.raises(ValueError, match=name):
            Options(**{name: bad})
    with pytest.raises(TypeError):
        Options(reference="yes")
    with pytest.raises(ValueError):
        Options(cohort_edges=0)
    with pytest.raises(TypeError):
        Options(cohort_edges=2.5)


def test_auto_on_cuda_takes_every_fast_path_and_the_reference_on_the_cpu():
    cuda = resolve("cuda")
    assert (cuda.zonal, cuda.edge_frame, cuda.memory) == ("fused", "packed", "keep")
    assert cuda.stack in ("layers", "fused") and cuda.precision == "3xtf32"
    assert cuda.planes and cuda.cohorts
    assert cuda.cohort_edges == ecekern.cohorts.COHORT_EDGES
    cpu = resolve("cpu")
    assert (cpu.zonal, cpu.edge_frame, cpu.stack, cpu.memory, cpu.precision) == (
        "reference",
        "reference",
        "linears",
        "plain",
        "fp32",
    )
    assert not cpu.planes and cpu.fallbacks == ()
    f64 = resolve("cuda", torch.float64)
    assert (f64.stack, f64.precision, f64.memory) == ("linears", "fp64", "keep")
    assert resolve("cuda", tf32=True, stack="linears").precision == "tf32"


def test_the_reference_switch_wins_and_says_what_it_ignores():
    p = resolve("cuda", reference=True, stack="layers", precision="bf16")
    assert (p.zonal, p.edge_frame, p.stack, p.memory, p.linear) == (
        "reference",
        "reference",
        "linears",
        "plain",
        "einsum",
    )
    assert p.precision == "fp32"
    assert {what for what, _ in p.notes} == {"stack='layers'", "precision='bf16'"}
    options.reset_fallback_warnings()
    with pytest.warns(UserWarning) as got:
        p.announce()
    said = sorted(str(w.message).split(" ignored")[0] for w in got)
    assert said == ["ecekern: precision='bf16'", "ecekern: stack='layers'"]


def test_impossible_combinations_are_errors_when_the_plan_is_made():
    with pytest.raises(ValueError, match="memory='plain'"):
        resolve("cuda", stack="layers", memory="plain")
    with pytest.raises(ValueError, match="3xtf32.*linears|linears.*3xtf32"):
        resolve("cuda", stack="linears", precision="3xtf32")
    with pytest.raises(ValueError, match="tf32"):
        resolve("cuda", stack="linears", precision="tf32")  # TF32 switch off


def test_inert_requests_warn_once():
    p = resolve("cpu", dtype=torch.float64, precision="tf32", cohort_edges=7)
    assert p.precision == "fp64" and p.memory == "plain"
    assert {what for what, _ in p.notes} == {"precision='tf32'", "cohort_edges=7"}
    p = resolve("cuda", linear="dense")  # the layer kernels run no linear
    assert p.notes and "linear='dense'" in p.notes[0][0]
    options.reset_fallback_warnings()
    with pytest.warns(UserWarning, match="linear='dense' ignored") as got:
        p.announce()
        p.announce()
    assert len(got) == 1


def test_fallbacks_are_in_the_plan_and_announced_once():
    """The fused stack without Gluon (Triton's interpreter on this machine, or a
    release it was not validated on) runs the layer kernels; the plan says why."""
    p = resolve("cuda", stack="fused", precision="bf16")
    if ecekern._triton.gluon is None:
        assert p.stack == "layers" and p.precision == "bf16"
        ((stage, why, to),) = p.fallbacks
        assert "fused" in stage and to == "the layer kernels in bf16"
        options.reset_fallback_warnings()
        with pytest.warns(options.FallbackWarning, match="fused"):
            p.announce()
    else:
        assert p.stack == "fused" and p.fallbacks == ()
    # the layer kernels take widths in multiples of 16: C = 3 gives F = 18
    odd = resolve("cuda", shapes=plan.Shapes(2, 2, 3, 1), stack="layers")
    assert odd.stack == "linears" and odd.precision == "fp32"
    assert "16" in odd.fallbacks[0][1]
    l5 = resolve("cuda", shapes=plan.Shapes(5, 5, 4, 1))
    assert l5.zonal == "reference" and l5.edge_frame == "reference"
    assert {s for s, _, _ in l5.fallbacks} >= {"zonal_scatter", "edge_frame"}


def test_a_compiled_step_runs_the_stack_as_linears_and_says_so():
    """While torch.compile traces, the plan runs the stack's linears with plain
    autograd (a compiled backward computes every parameter gradient; the stack
    kernels give the input gradient only), naming the fallback; the other stages
    keep their library ops."""
    eager = resolve("cuda", precision="tf32")
    assert (eager.stack, eager.memory, eager.precision) == ("layers", "keep", "tf32")
    cap = (9, 0)
    compiled = plan.resolve("cuda", cap, torch.float32, False, SHAPES,
                            Options(precision="tf32"), True)  # fmt: skip
    assert (compiled.stack, compiled.memory) == ("linears", "plain")
    assert compiled.precision == "fp32" and not compiled.cohorts
    assert (compiled.zonal, compiled.edge_frame) == (eager.zonal, eager.edge_frame)
    ((stage, why, to),) = compiled.fallbacks
    assert "layers" in stage and "torch.compile" in why and "fp32" in to
    asked = plan.resolve("cuda", cap, torch.float32, False, SHAPES,
                         Options(stack="fused", memory="recompute"), True)  # fmt: skip
    assert (asked.stack, asked.memory) == ("linears", "plain")
    assert [s for s, _, _ in asked.fallbacks] == [
        "mixing stack [fused]", "cohorts [recompute]"]  # fmt: skip


def test_a_direct_stack_call_under_compile_falls_back_loudly():
    """cohorts.mixing_stack asked for kernels while compiling: the plain stack,
    the same values, and a FallbackWarning naming torch.compile."""
    from ecekern import cohorts, reference

    g = torch.Generator().manual_seed(0)
    F, FO = 16, 16
    x = [torch.randn(5, F, 3, generator=g, dtype=torch.float64) for _ in range(2)]
    ws = [torch.randn(3, F, F, generator=g, dtype=torch.float64) / 4]
    wo = torch.randn(3, FO, F, generator=g, dtype=torch.float64) / 4

    def f(xc, xs):
        return cohorts.mixing_stack(xc, xs, ws, [None], wo, None, kernels="layers")

    options.reset_fallback_warnings()
    torch._dynamo.reset()
    with pytest.warns(options.FallbackWarning, match="torch.compile"):
        got = torch.compile(f, backend="eager")(*x)
    ref = reference.mixing_stack(*x, ws, [None], wo, None)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_plans_are_cached_and_read_the_environment_at_plan_time(monkeypatch):
    model = ecekern.ECEModel(TINY)
    assert model.plan() is model.plan()
    monkeypatch.setenv("ECEKERN_STACK", "layers")
    monkeypatch.setenv("ECEKERN_PRECISION", "fp32")
    monkeypatch.setenv("ECEKERN_COHORT_EDGES", "4096")
    p = model.plan()
    assert p.options == Options(stack="layers", precision="fp32", cohort_edges=4096)
    with options.use(stack="linears", precision="auto"):  # code wins over the env
        assert model.plan().stack == "linears"
    monkeypatch.setenv("ECEKERN_STACK", "Layers")
    with pytest.raises(ValueError, match="ECEKERN_STACK"):
        model.plan()
    monkeypatch.setenv("ECEKERN_STACK", "auto")
    monkeypatch.setenv("ECEKERN_COHORT_EDGES", "many")
    with pytest.raises(ValueError, match="ECEKERN_COHORT_EDGES"):
        model.plan()
    env = {"ECEKERN_COHORT_EDGE": "5", "ECEKERN_COMMIT": "x", "ECEKERN_STACK": "x"}
    assert options._unknown_variables(env) == ["ECEKERN_COHORT_EDGE"]  # misspelt


def test_a_bad_option_is_refused_before_the_block_runs():
    ran = []
    with pytest.raises(ValueError, match="stack"):
        with options.use(stack="fast"):
            ran.append(1)
    assert ran == [] and options.current() == Options()


def test_the_repr_names_every_stage():
    text = repr(resolve("cuda", memory="recompute", cohort_edges=1000))
    for word in ("cuda sm_90", "float32", "zonal", "edge_frame", "stack", "memory",
                 "recompute, cohorts of 1000 edges", "fallbacks"):  # fmt: skip
        assert word in text
    assert (
        resolve("cpu")
        .describe()
        .startswith("geometry=reference,radial=reference,zonal=reference,edge_frame=")
    )


def test_the_geometry_and_radial_stages():
    """Chapter 7's stages: the reference by default (the fused kernels await their
    GPU validation), fused when asked (the radial kernel in the stack's precision);
    the fused geometry only beside the packed edge-frame kernels (it never forms D),
    and a degree its tiles do not cover falls back loudly."""
    FUSED = dict(geometry="fused", radial="fused")
    cuda = resolve("cuda", **FUSED)
    assert (cuda.geometry, cuda.radial, cuda.radial_precision) == (
        "fused", "fused", "3xtf32")  # fmt: skip
    assert cuda.fallbacks == ()
    bf16 = resolve("cuda", precision="bf16", stack="layers", **FUSED)
    assert bf16.radial_precision == "tf32"
    assert resolve("cuda", dtype=torch.float64, **FUSED).radial_precision == "fp32"
    for auto in (resolve("cpu"), resolve("cuda")):
        assert (auto.geometry, auto.radial, auto.fallbacks) == (
            "reference", "reference", ())  # fmt: skip
    asked = resolve("cuda", edge_frame="table", geometry="fused")
    ((stage, why, to),) = asked.fallbacks
    assert asked.geometry == "reference" and stage == "geometry [fused]"
    assert "edge_frame='table'" in why and "reference" in to
    l4 = resolve("cuda", shapes=plan.Shapes(4, 2, 4, 1), geometry="fused")
    assert l4.geometry == "reference"
    assert any(s == "geometry [fused]" and "tiles" in w for s, w, _ in l4.fallbacks)
    both = resolve("cuda", reference=True)
    assert (both.geometry, both.radial) == ("reference", "reference")
    wide = resolve("cuda", shapes=SHAPES._replace(radial=(8, 256, 64, 448)),
                   radial="fused")  # fmt: skip
    assert wide.radial == "reference"
    assert any(s == "radial [fused]" for s, _, _ in wide.fallbacks)


def test_two_threads_with_different_options_get_their_own_plans_and_results():
    """Each thread's ``options.use`` block is its own (a ContextVar): run at once,
    behind a barrier, each gets the plan and the energy it gets alone."""
    model = ecekern.ECEModel(TINY).double()
    atoms = ecekern.systems.diamond(1, rattle=0.1, seed=3)
    asks = {"a": dict(reference=True), "b": dict(linear="dense", memory="keep",
                                                 cohort_edges=5)}  # fmt: skip
    alone = {}
    for name, ask in asks.items():
        with options.use(**ask):
            alone[name] = (model.plan(), ecekern.energy_and_forces(model, atoms))
    assert alone["a"][0].linear == "einsum" and alone["b"][0].linear == "dense"
    assert alone["b"][0].cohorts and not alone["a"][0].cohorts
    barrier, got, errors = threading.Barrier(2), {}, []

    def run(name):
        try:
            with options.use(**asks[name]):
                barrier.wait(timeout=60)  # both blocks are open now
                for _ in range(3):
                    p = model.plan()
                    e, f = ecekern.energy_and_forces(model, atoms)
                    got.setdefault(name, []).append((p, e, f))
                barrier.wait(timeout=60)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in asks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    for name, runs in got.items():
        plan_alone, (e0, f0) = alone[name]
        for p, e, f in runs:
            assert p is plan_alone
            assert torch.equal(e, e0) and torch.equal(f, f0)
    assert options.current() == Options()  # nothing leaked into this thread


def test_set_options_is_scoped_to_its_thread():
    seen = []

    def other():
        seen.append(options.current())

    token_before = options.current()
    previous = options.set_options(zonal="fused")
    try:
        assert options.current().zonal == "fused"
        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert seen == [Options()]
    finally:
        options.reset()
    assert previous == token_before and options.current() == Options()


def test_a_new_plan_is_logged_once(caplog):
    opts = dict(cohort_edges=12345, memory="keep")  # a plan no other test makes
    with caplog.at_level("INFO", logger="ecekern.plan"):
        resolve("cpu", **opts)
        resolve("cpu", **opts)
    said = [r.getMessage() for r in caplog.records if r.name == "ecekern.plan"]
    assert len(said) == 1 and "cohorts of 12345 edges" in said[0]


def test_the_edge_layer_stage():
    """Chapter 8's fused edge layer: off unless asked (not yet measured on a GPU);
    asked, it runs where Triton does, in the stack's precision, and a traced step
    falls back loudly to the stages apart."""
    for auto in (resolve("cpu"), resolve("cuda")):
        assert auto.edge_layer == "off"
    on = resolve("cuda", edge_layer="triton")
    assert (on.edge_layer, on.precision, on.fallbacks) == ("triton", "3xtf32", ())
    assert "edge_layer  triton, 3xtf32" in repr(on)
    assert ("edge_layer", "triton", "kernels",
            "PyTorch (the layer recomputed)") in on.derivatives()  # fmt: skip
    traced = plan.resolve("cuda", (9, 0), torch.float32, False, SHAPES,
                          Options(edge_layer="triton"), compiling=True)  # fmt: skip
    assert traced.edge_layer == "off"
    assert any(s == "edge_layer [triton]" for s, _, _ in traced.fallbacks)
    half = resolve("cuda", dtype=torch.float16, edge_layer="triton")
    assert half.edge_layer == "off"
