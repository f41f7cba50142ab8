"""Chapter 6: the mixing stack in cohorts and its layer kernels (ecekern.cohorts).

Three ways where the arithmetic differs (float32 against float64); to about 1e-12 in
float64, where the arithmetic is the reference's in another order of rows."""

import functools
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

import ecekern
from ecekern import cohorts, options, reference, stack_fused, stack_layers
from ecekern._planes import as_planes, planes_pair
from ecekern._stack_common import PRECISIONS, split_tf32
from ecekern._triton import AVAILABLE as TRITON_AVAILABLE
from ecekern._triton import INTERPRET
from ecekern.model import force_step, prepare_inputs
from ecekern.testing import assert_close_three_way, rel_err

# these tests run the kernels on CPU tensors: in Triton's interpreter (their GPU
# twins are the gpu-marked tests)
needs_triton = pytest.mark.skipif(
    not (TRITON_AVAILABLE and INTERPRET),
    reason="CPU tensors run the kernels in Triton's interpreter only",
)


def _stack_args(E, F=8, Fo=6, n_ang=2, K=2, dtype=torch.float64, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):  # drawn in float64 (randn's float32 stream differs)
        t = scale * torch.randn(*shape, generator=g, dtype=torch.float64)
        return t.to(dtype).requires_grad_()

    x = [r(E, F, n_ang) for _ in range(2)]
    weights = [r(n_ang, F, F, scale=F**-0.5) for _ in range(K)]
    biases = [r(F) if bias else None for _ in range(K)]
    w_out = r(n_ang, Fo, F, scale=F**-0.5)
    b_out = r(Fo) if bias else None
    return x, weights, biases, w_out, b_out


def _grads(fn, x, weights, biases, w_out, b_out, seed=1):
    y = fn(*x, weights, biases, w_out, b_out)
    g = torch.Generator().manual_seed(seed)
    gy = [
        torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.device, t.dtype)
        for t in y
    ]
    wrt = [*x, *weights, *[b for b in biases if b is not None], w_out]
    wrt += [b_out] if b_out is not None else []
    return y, torch.autograd.grad(y, wrt, gy)


def _spy(monkeypatch, module, name):
    """The calls of ``module.name`` (a list, one entry a call), which still runs."""
    calls, real = [], getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


@pytest.mark.parametrize(
    "E, cohort",
    [
        (0, 4),
        (1, 4),
        (37, 4),
        (37, 37),
        (37, 8192),
        (8191, 8192),
        (8192, 8192),
        (8193, 8192),
    ],  # fmt: skip
)
def test_fp64_matches_reference_forward_and_backward(E, cohort):
    args = _stack_args(E)
    y_ref, g_ref = _grads(reference.mixing_stack, *args)
    y, g = _grads(
        lambda *a: cohorts.mixing_stack(*a, cohort_edges=cohort), *args
    )  # fmt: skip
    for a, b in zip((*y, *g), (*y_ref, *g_ref), strict=True):
        assert a.shape == b.shape
        if b.numel():
            assert rel_err(a, b) < 1e-12


@pytest.mark.parametrize("recompute", [False, True], ids=["keep_z", "recompute"])
@pytest.mark.parametrize(
    "E, cohort", [(0, 4), (1, 4), (37, 4), (37, 8192), (8191, 8192), (8193, 8192)]
)
def test_fp64_force_backward_matches_reference(monkeypatch, E, cohort, recompute):
    """A force step's backward (the inputs only; the weights require grad but are not
    asked for): from the kept pre-activations, or by recomputing each cohort; which
    of the two ran is checked too (both give the same numbers)."""
    kept = _spy(monkeypatch, cohorts, "_input_backward")
    rerun = _spy(monkeypatch, cohorts, "_cohort_backward")
    args = _stack_args(E, K=3)
    x = args[0]
    gy = None
    outs = []
    for fn in (
        reference.mixing_stack,
        lambda *a: cohorts.mixing_stack(*a, cohort_edges=cohort, recompute=recompute),
    ):
        y = fn(*args[0], *args[1:])
        if gy is None:
            g = torch.Generator().manual_seed(2)
            gy = [
                torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.dtype)
                for t in y
            ]
        outs.append((*y, *torch.autograd.grad(y, x, gy)))
    for a, b in zip(*reversed(outs), strict=True):
        assert a.shape == b.shape
        if b.numel():
            assert rel_err(a, b) < 1e-12
    assert (len(kept), len(rerun)) == ((0, 1) if recompute else (1, 0))
    assert all(call[-1] == [] for call in rerun)  # dx only, no weight gradient


def test_float32_three_way_against_float64():
    args64 = _stack_args(45, K=3)
    y64, g64 = _grads(reference.mixing_stack, *args64)
    args32 = _stack_args(45, K=3, dtype=torch.float32)
    y32_ref, g32_ref = _grads(reference.mixing_stack, *args32)
    y32, g32 = _grads(lambda *a: cohorts.mixing_stack(*a, cohort_edges=8), *args32)
    for out, ref32, ref64 in zip((*y32, *g32), (*y32_ref, *g32_ref), (*y64, *g64),
                                 strict=True):  # fmt: skip
        assert_close_three_way(out, ref32, ref64, "cohort stack")
    gy = [torch.ones_like(t) for t in y32]  # the force step's path (kept z_k)
    d32 = torch.autograd.grad(
        cohorts.mixing_stack(*args32[0], *args32[1:], cohort_edges=8), args32[0], gy
    )
    d32_ref = torch.autograd.grad(
        reference.mixing_stack(*args32[0], *args32[1:]), args32[0], gy
    )
    d64 = torch.autograd.grad(
        reference.mixing_stack(*args64[0], *args64[1:]),
        args64[0],
        [t.double() for t in gy],
    )
    for out, ref32, ref64 in zip(d32, d32_ref, d64, strict=True):
        assert_close_three_way(out, ref32, ref64, "cohort stack, kept z")


def test_no_biases_leading_dims_and_strided_inputs():
    x, weights, biases, w_out, b_out = _stack_args(12, bias=False)
    # (3, 4) leading rows, from a transposed buffer: neither input is contiguous
    xs = [t.detach().reshape(3, 4, 8, 2).transpose(0, 1).requires_grad_() for t in x]
    assert not xs[0].is_contiguous()
    y_ref = reference.mixing_stack(*xs, weights, biases, w_out, b_out)
    y = cohorts.mixing_stack(*xs, weights, biases, w_out, b_out, cohort_edges=5)
    assert y[0].shape == (4, 3, 6, 2)
    for a, b in zip(y, y_ref, strict=True):
        assert rel_err(a, b) < 1e-12
    gy = [torch.ones_like(t) for t in y]
    d_ref = torch.autograd.grad(y_ref, xs, gy)
    d = torch.autograd.grad(y, xs, gy)
    for a, b in zip(d, d_ref, strict=True):
        assert rel_err(a, b) < 1e-12


def test_only_what_is_asked_for():
    """A force step asks for the inputs only; training asks for the weights too."""
    x, weights, biases, w_out, b_out = _stack_args(20)
    y = cohorts.mixing_stack(*x, weights, biases, w_out, b_out, cohort_edges=6)
    (dw,) = torch.autograd.grad(y[0].sum() + y[1].sum(), [weights[1]])
    y_ref = reference.mixing_stack(*x, weights, biases, w_out, b_out)
    (dw_ref,) = torch.autograd.grad(y_ref[0].sum() + y_ref[1].sum(), [weights[1]])
    assert rel_err(dw, dw_ref) < 1e-12
    y = cohorts.mixing_stack(*x, weights, biases, w_out, b_out, cohort_edges=6)
    (y[0].sum() + y[1].sum()).backward()  # .grad accumulates as usual
    assert weights[0].grad is not None and x[0].grad is not None


def test_saves_the_input_the_parameters_and_the_preactivations():
    """What autograd keeps for the backward: the stack's input and (unless
    ``recompute``) the K pre-activations, not every activation (the reference keeps
    every layer's)."""
    args = _stack_args(64, K=2)
    (x, weights, biases, w_out, b_out) = args

    def saved_values(fn):
        seen = {}

        def pack(t):
            seen[t.data_ptr(), t.dtype, tuple(t.shape)] = t.numel()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(*x, weights, biases, w_out, b_out)
        return sum(seen.values())

    params = sum(p.numel() for p in (*weights, *biases, w_out, b_out))
    inputs = sum(t.numel() for t in x)
    recomputing = functools.partial(cohorts.mixing_stack, recompute=True)
    assert saved_values(recomputing) == inputs + params
    assert saved_values(cohorts.mixing_stack) == 3 * inputs + params  # K = 2
    assert saved_values(reference.mixing_stack) > 3 * inputs


def test_double_backward_gradgradcheck():
    x, weights, biases, w_out, b_out = _stack_args(7, F=4, Fo=3, K=1)

    def f(xc, xs, w):
        return cohorts.mixing_stack(xc, xs, [w], biases, w_out, b_out, cohort_edges=3)

    assert torch.autograd.gradgradcheck(f, (*x, weights[0]))


@needs_triton
def test_double_backward_through_the_layer_kernels_falls_back_differentiably():
    """With the layer kernels (and the m = 0 sin column skipped), a backward that
    builds a graph reruns the stack on the linears: second derivatives by
    ``gradgradcheck`` in x_cos (the interpreter's kernels are slow), two cohorts."""
    (xc, xs), weights, biases, w_out, b_out = _stack_args(2, F=16, Fo=16, K=1)

    def f(xc):
        return cohorts.mixing_stack(
            xc, xs, weights, biases, w_out, b_out, cohort_edges=1, kernels="layers",
            sin0_zero=True,
        )  # fmt: skip

    assert torch.autograd.gradgradcheck(f, (xc,))


def test_bad_inputs():
    x, weights, biases, w_out, b_out = _stack_args(4)
    for bad, err in ((0, ValueError), (-2, ValueError), (1.5, TypeError),
                     (True, TypeError), ("8", TypeError)):  # fmt: skip
        with pytest.raises(err, match="cohort_edges"):
            cohorts.mixing_stack(*x, weights, biases, w_out, b_out, cohort_edges=bad)
    with pytest.raises(ValueError, match="biases"):
        cohorts.mixing_stack(*x, weights, biases[:1], w_out, b_out)
    with pytest.raises(ValueError, match="differ"):
        cohorts.mixing_stack(x[0], x[1][:2], weights, biases, w_out, b_out)
    with pytest.raises(ValueError, match="weights"):  # a weight of the wrong width
        cohorts.mixing_stack(*x, [weights[0][:, :3]] * 2, biases, w_out, b_out)
    for w_bad in (w_out[0], None, w_out[:, :, :3]):  # 2-D, missing, the wrong F
        with pytest.raises(ValueError, match="weight_out"):
            cohorts.mixing_stack(*x, weights, biases, w_bad, b_out)
    with pytest.raises(TypeError, match="recompute"):
        cohorts.mixing_stack(*x, weights, biases, w_out, b_out, recompute="no")
    # each bias and weight is named, before any layer runs
    with pytest.raises(ValueError, match=r"bias_out must be None or \(\d+,\)"):
        cohorts.mixing_stack(*x, weights, biases, w_out, torch.zeros_like(w_out[0, 0]))
    with pytest.raises(ValueError, match=r"biases\[1\]"):
        cohorts.mixing_stack(*x, weights, [biases[0], b_out[:1]], w_out, b_out)
    with pytest.raises(TypeError, match=r"weights\[1\] has dtype torch.float32"):
        cohorts.mixing_stack(*x, [weights[0], weights[1].float()], biases, w_out, b_out)
    with pytest.raises(TypeError, match="x_cos must be a tensor, got list"):
        cohorts.mixing_stack([1.0], x[1], weights, biases, w_out, b_out)
    with pytest.raises(TypeError, match="weights must be a list, got Tensor"):
        cohorts.mixing_stack(*x, torch.stack(weights), biases, w_out, b_out)


@pytest.mark.parametrize(
    "kernels",
    [None, pytest.param("layers", marks=needs_triton)],
    ids=["linears", "kernels"],
)
@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_without_autograd_nothing_is_kept(monkeypatch, mode, kernels):
    """Under no_grad or inference_mode (weights that require grad included) the
    stack is the plain forward, equal to the reference: the autograd function that
    keeps tensors for a backward is not entered."""
    x, weights, biases, w_out, b_out = _stack_args(9, F=16, Fo=16)
    entered = _spy(monkeypatch, cohorts._CohortStack, "apply")
    with mode():
        y = cohorts.mixing_stack(*x, weights, biases, w_out, b_out, cohort_edges=4,
                                 kernels=kernels)  # fmt: skip
        ref = reference.mixing_stack(*x, weights, biases, w_out, b_out)
    assert not entered
    assert all(rel_err(a, b) < 1e-12 for a, b in zip(y, ref, strict=True))


@pytest.mark.parametrize("sin0", [False, True], ids=["all", "sin0"])
@pytest.mark.parametrize("sizes", [(37, 8193, 16385)])
def test_compile_with_sizes_that_vary(sizes, sin0):
    """Traced at 37 edges, called at 8193 and 16385: the compiled function is not
    fixed to its first example (the seed's review found one that was), and a new
    size compiles once at most (then a dynamic graph serves the rest). Eager, the
    same calls run 1 to 5 cohorts of 4096."""
    from torch._dynamo.utils import counters

    _, weights, biases, w_out, b_out = _stack_args(1)
    torch._dynamo.reset()
    counters.clear()

    def f(xc, xs):
        y = cohorts.mixing_stack(xc, xs, weights, biases, w_out, b_out,
                                 cohort_edges=4096, sin0_zero=sin0)  # fmt: skip
        return (y[0] ** 2).sum() + y[1].sum()

    compiled = torch.compile(f, backend="aot_eager")
    for E in sizes:
        x = [t.detach().requires_grad_() for t in _stack_args(E, seed=E)[0]]
        e, g = compiled(*x), None
        g = torch.autograd.grad(e, x)
        e_ref = f(*x)
        g_ref = torch.autograd.grad(e_ref, x)
        assert rel_err(e, e_ref) < 1e-12
        for a, b in zip(g, g_ref, strict=True):
            assert rel_err(a, b) < 1e-12
    assert counters["stats"]["unique_graphs"] <= 2  # the first size, then dynamic


@pytest.mark.parametrize(
    "channels, opts",
    [
        (4, {"memory": "keep", "cohort_edges": 50}),
        (4, {"memory": "recompute", "cohort_edges": 50}),
        pytest.param(
            16,
            {
                "stack": "layers",
                "memory": "keep",
                "cohort_edges": 50,
                "edge_frame": "packed",
            },
            marks=needs_triton,
        ),
        pytest.param(
            16,
            {
                "stack": "layers",
                "memory": "recompute",
                "cohort_edges": 50,
                "edge_frame": "packed",
            },
            marks=[needs_triton, pytest.mark.slow],
        ),  # fmt: skip
    ],
    ids=["keep_z", "recompute", "fused", "fused-recompute"],
)
def test_model_with_cohorts_equals_without(monkeypatch, request, channels, opts):
    """The model's step in cohorts equals the plain step in float64, keeping z,
    recomputing, and with the layer kernels keeping z or recomputing it (channels
    16: F = 96, F' = 48, a factor 16 in both); the model's stack skips the m = 0
    sin part (``sin0_zero``), so this also checks that part is zero. With the
    kernels, chapter 3's edge-frame kernels hand the rows over as planes (no
    copies), and the stack's output and gradients stay planes."""
    cfg = ecekern.ECEConfig(
        channels=channels, radial_hidden=8, readout_hidden=8, n_gated=2, cutoff=3.0
    )
    model = ecekern.ECEModel(cfg).double()
    inputs = prepare_inputs(
        ecekern.systems.diamond(1, rattle=0.1, seed=3), cfg.cutoff, torch.float64, "cpu"
    )
    with options.use(memory="plain"):  # whatever the environment says
        assert model.plan().stack == "linears"
        e_ref, f_ref = force_step(model, *inputs)
    paths = {  # the backward each variant must take (the others: never)
        "_input_backward": (cohorts, "keep_z"),
        "_cohort_backward": (cohorts, "recompute"),
        "stack_backward": (stack_layers, "fused"),
        "stack_recompute_backward": (stack_layers, "fused-recompute"),
    }
    calls = {n: _spy(monkeypatch, mod, n) for n, (mod, _) in paths.items()}
    with options.use(**opts):
        plan = model.plan()
        assert (plan.memory, plan.stack) == (
            opts["memory"],
            opts.get("stack", "linears"),
        )
        e, f = force_step(model, *inputs)
    assert rel_err(e, e_ref) < 1e-12 and rel_err(f, f_ref) < 1e-12
    variant = request.node.callspec.id
    for n, (_, which) in paths.items():  # one stack a layer, its backward once
        assert len(calls[n]) == (cfg.n_interactions if which == variant else 0), n


@pytest.mark.parametrize(
    "edge_frame, fused",
    [
        ("reference", "linears"),
        pytest.param("packed", "linears", marks=[needs_triton, pytest.mark.slow]),
        pytest.param("packed", "layers", marks=[needs_triton, pytest.mark.slow]),
    ],
    ids=["reference", "packed", "packed-kernels"],
)
def test_model_keeps_no_stack_input_and_rebuilds_it_only_where_read(
    monkeypatch, edge_frame, fused
):
    """With cohorts on, the model's stacks keep none of their input rows: after the
    forward the rows are gone (weak references die), keeping z or recomputing. A
    force step's backward from the kept z never makes them again; recomputing
    makes them once a layer by the rotation, and so does training (the weights'
    gradients). Energy, forces, the weights' gradients and a second derivative (a
    force loss's) equal the plain stack's in float64, and the recipes (with the h
    and rho they hold) go with the graph by reference counting alone."""
    import gc
    import weakref

    from ecekern import model as model_mod

    cfg = ecekern.ECEConfig(channels=16 if fused != "linears" else 4, lmax=1,
                            cutoff=2.0,
                            radial_hidden=8, readout_hidden=8, n_gated=2)  # fmt: skip
    model = ecekern.ECEModel(cfg).double()
    inputs = prepare_inputs(
        ecekern.systems.diamond(1, rattle=0.2, seed=5), cfg.cutoff, torch.float64
    )
    seen, rebuilt, recipes = [], [], []
    real_stack, real_rebuild = model_mod._cohort_stack, model_mod.ECEModel._rebuild

    def stack_spy(layer, plan, x_cos, x_sin, x_rebuild=None):
        # the allocations (a planes pair's views share one base, which any view
        # that the stack keeps would hold)
        seen.append(tuple(weakref.ref(t if t._base is None else t._base)
                          for t in (x_cos, x_sin)))  # fmt: skip
        return real_stack(layer, plan, x_cos, x_sin, x_rebuild)

    def rebuild_spy(*args):
        make = real_rebuild(*args)
        if make is None:
            return None

        def counted():
            rebuilt.append(1)
            return make()

        recipes.append(weakref.ref(counted))
        return counted

    monkeypatch.setattr(model_mod, "_cohort_stack", stack_spy)
    monkeypatch.setattr(model_mod.ECEModel, "_rebuild", staticmethod(rebuild_spy))
    params = list(model.parameters())

    def run(**opts):
        seen.clear()
        rebuilt.clear()
        if opts["memory"] != "plain":
            opts |= dict(cohort_edges=64, stack=fused)
        with options.use(edge_frame=edge_frame, **opts):
            x = inputs[0].clone().requires_grad_()
            energy = model(x, *inputs[1:])
            gc.collect()
            alive = [r() is not None for pair in seen for r in pair]
            (grad,) = torch.autograd.grad(energy, x)
            n_force = len(rebuilt)
            rebuilt.clear()
            e = model(*inputs)
            g1 = torch.autograd.grad(e, params, allow_unused=True)  # training
            n_train = len(rebuilt)
            e2, f2 = force_step(model, *inputs, create_graph=True)
            g2 = torch.autograd.grad((f2**2).sum(), params, allow_unused=True)
        grads = [g for g in (*g1, *g2) if g is not None]
        return alive, n_force, n_train, (energy.detach(), -grad, grads)

    _, _, _, ref = run(memory="plain")
    n = cfg.n_interactions
    for recompute in (False, True):
        memory = "recompute" if recompute else "keep"
        alive, n_force, n_train, got = run(memory=memory)
        assert alive == [False] * (2 * n)  # (no zeroed copy kept either)
        assert n_force == (n if recompute else 0)
        assert n_train == n
        assert rel_err(got[0], ref[0]) < 1e-12 and rel_err(got[1], ref[1]) < 1e-12
        assert len(got[2]) == len(ref[2]) > 0
        for a, b in zip(got[2], ref[2], strict=True):
            assert rel_err(a, b) < 1e-12
    recipes.clear()
    gc.collect()
    gc.disable()
    try:
        with options.use(memory="recompute", edge_frame=edge_frame,
                         cohort_edges=64, stack=fused):  # fmt: skip
            force_step(model, *inputs)
        assert len(recipes) == n
        assert all(r() is None for r in recipes)
    finally:
        gc.enable()


def test_x_rebuild_is_checked():
    """A recipe that makes other rows than the forward's is a clear error in the
    backward; one that is not callable, at the call."""
    g = torch.Generator().manual_seed(3)
    E, F, n_ang = 20, 6, 3
    x = [torch.randn(E, F, n_ang, dtype=torch.float64, generator=g,
                     requires_grad=True) for _ in "cs"]  # fmt: skip
    ws = [torch.randn(n_ang, F, F, dtype=torch.float64, generator=g,
                      requires_grad=True)]  # fmt: skip
    wo = torch.randn(n_ang, 4, F, dtype=torch.float64, generator=g)
    args = (ws, [None], wo, None)
    with pytest.raises(TypeError, match="x_rebuild"):
        cohorts.mixing_stack(*x, *args, x_rebuild="x")
    bad = (x[0][:10].detach(), x[1][:10].detach())
    y = cohorts.mixing_stack(*x, *args, cohort_edges=8, x_rebuild=lambda: bad)
    with pytest.raises(RuntimeError, match="x_rebuild made x_cos"):
        torch.autograd.grad(y[0].sum(), ws)  # the weights' gradient reads x
    good = (x[0].detach(), x[1].detach())
    y = cohorts.mixing_stack(*x, *args, cohort_edges=8, x_rebuild=lambda: good)
    y_ref = reference.mixing_stack(*x, *args)
    for a, b in zip(y, y_ref, strict=True):
        assert rel_err(a, b) < 1e-12
    gy = [torch.randn_like(t) for t in y]
    got = torch.autograd.grad(y, [*x, *ws], gy)
    want = torch.autograd.grad(y_ref, [*x, *ws], gy)
    for a, b in zip(got, want, strict=True):
        assert rel_err(a, b) < 1e-12


def test_cohort_options_without_cohorts_warn_once():
    """On the CPU cohorts are off unless asked for: cohort options set alone would
    change nothing, and the model says so, once; the numbers are the reference's."""
    cfg = ecekern.ECEConfig(channels=4, radial_hidden=8, readout_hidden=8, cutoff=3.0)
    model = ecekern.ECEModel(cfg).double()
    inputs = prepare_inputs(
        ecekern.systems.diamond(1, rattle=0.1, seed=3), cfg.cutoff, torch.float64, "cpu"
    )
    with options.use(memory="plain"):
        e_ref, _ = force_step(model, *inputs)
    options.reset_fallback_warnings()
    with options.use(cohort_edges=7):  # memory "auto": plain on the CPU
        assert not model.plan().cohorts
        with pytest.warns(UserWarning, match=r"cohort_edges=7 ignored"):
            e, _ = force_step(model, *inputs)
        assert float(e) == float(e_ref)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once: the second step says nothing
            force_step(model, *inputs)
    with options.use(stack="linears"), warnings.catch_warnings():
        warnings.simplefilter("error")  # the linears are what runs: nothing inert
        force_step(model, *inputs)


@pytest.mark.gpu
def test_gpu_model_with_cohorts_three_way():
    """On CUDA with the library's defaults (the layer kernels in 3xTF32), keeping z
    and recomputing it: float32 within the three-way rule of float64, forces
    included."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    atoms = ecekern.systems.diamond(2, rattle=0.2, seed=4)
    model = ecekern.ECEModel().to("cuda", torch.float64)
    truth = force_step(model, *prepare_inputs(atoms, 5.0, torch.float64, "cuda"))
    model = model.float()
    inputs = prepare_inputs(atoms, 5.0, torch.float32, "cuda")
    with options.use(memory="plain", stack="linears"):
        plain = force_step(model, *inputs)
    for recompute in (False, True):
        memory = "recompute" if recompute else "keep"
        with options.use(memory=memory, cohort_edges=1000):
            got = force_step(model, *inputs)
        for a, b, t in zip(got, plain, truth, strict=True):
            assert_close_three_way(a, b, t, f"cohorts on CUDA, recompute={recompute}")


def test_cohort_edges_option(monkeypatch):
    """The option's "auto" is the function's default; the environment sets it as an
    int; a bad value is an error naming the variable; the model passes it through."""
    cfg = ecekern.ECEConfig(channels=2, n_gated=1, radial_hidden=4, readout_hidden=4)
    model = ecekern.ECEModel(cfg).double()
    with options.use(memory="keep"):
        assert model.plan().cohort_edges == cohorts.COHORT_EDGES
    monkeypatch.setenv("ECEKERN_COHORT_EDGES", "4096")
    with options.use(memory="keep"):
        assert model.plan().cohort_edges == 4096
    for bad in ("many", "0", "-3"):
        monkeypatch.setenv("ECEKERN_COHORT_EDGES", bad)
        with pytest.raises(ValueError, match="ECEKERN_COHORT_EDGES"):
            model.plan()
    monkeypatch.delenv("ECEKERN_COHORT_EDGES")
    for bad in (True, 2.0, "8"):  # an int or any integer type, nothing else
        with pytest.raises((TypeError, ValueError), match="cohort_edges"):
            options.Options(cohort_edges=bad)
    assert type(options.Options(cohort_edges=np.int64(7)).cohort_edges) is int
    seen = []
    real = cohorts.mixing_stack

    def spy(*args, **kw):
        seen.append(kw["cohort_edges"])
        return real(*args, **kw)

    monkeypatch.setattr(cohorts, "mixing_stack", spy)
    atoms = ecekern.systems.diamond(1, rattle=0.05, seed=1)
    with options.use(memory="keep", cohort_edges=7):
        ecekern.energy_and_forces(model, atoms)
    assert seen and set(seen) == {7}


# the layer kernels (ecekern.stack_layers), in Triton's interpreter on the CPU
def _fused_args(E, K, n_ang, bias, dtype=torch.float64, F=32, Fo=16, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):  # drawn in float64: the same values in every dtype
        return (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype)

    x = [r(E, F, n_ang).requires_grad_() for _ in range(2)]
    ws = [r(n_ang, F, F, scale=F**-0.5) for _ in range(K)]
    bs = [r(F) if bias else None for _ in range(K)]
    return x, ws, bs, r(n_ang, Fo, F, scale=F**-0.5), r(Fo) if bias else None


def _fwd_and_force_bwd(fn, x, *args, seed=3):
    y = fn(*x, *args)
    g = torch.Generator().manual_seed(seed)
    gy = [
        torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.device, t.dtype)
        for t in y
    ]
    return (*y, *torch.autograd.grad(y, x, gy))


@needs_triton
@pytest.mark.parametrize(
    "E, K, n_ang, bias, cohort",
    [
        (0, 2, 3, True, 64),
        (1, 1, 2, False, 64),
        (17, 0, 3, True, 5),
        (37, 2, 3, True, 64),
        (37, 3, 3, True, 16),
        (200, 2, 1, True, 64),
        (130, 2, 3, False, 64),
    ],  # fmt: skip
)
@pytest.mark.parametrize(
    "recompute, sin0", [(False, False), (True, False), (False, True), (True, True)],
    ids=["keep_z", "recompute", "keep_z-sin0", "recompute-sin0"],
)  # fmt: skip
def test_layers_fp64_match_reference(E, K, n_ang, bias, cohort, recompute, sin0):
    """Forward and the force step's backward (from the z_k the kernels keep, or
    recomputing them a cohort at a time), with tail tiles (64 edges a tile), one
    cohort and several (37 rows in cohorts of 16: 16, 16, 5), no gated layer, one
    order. With ``sin0_zero`` against the reference on x_sin with its m = 0 column
    zeroed: the inputs' column (and the output gradient's) is not zero here, so a
    kernel that read it, or a dx_sin[..., 0] that is not zero, fails."""
    x, *args = _fused_args(E, K, n_ang, bias)
    got = _fwd_and_force_bwd(
        lambda *a: cohorts.mixing_stack(*a, kernels="layers", cohort_edges=cohort,
                                        recompute=recompute, sin0_zero=sin0),
        x, *args,
    )  # fmt: skip
    ref = _fwd_and_force_bwd(_reference_sin0 if sin0 else reference.mixing_stack,
                             x, *args)  # fmt: skip
    for a, b in zip(got, ref, strict=True):
        assert a.shape == b.shape
        if b.numel():
            assert rel_err(a, b) < 1e-12
    if sin0 and E:
        assert not got[1][..., 0].any() and not got[3][..., 0].any()


def _reference_sin0(x_cos, x_sin, *args):
    """The reference stack on x_sin with its m = 0 column zeroed (differentiably)."""
    zeroed = torch.cat([torch.zeros_like(x_sin[..., :1]), x_sin[..., 1:]], -1)
    return reference.mixing_stack(x_cos, zeroed, *args)


@needs_triton
@pytest.mark.parametrize("kernels", [None, "layers"], ids=["linears", "kernels"])
def test_sin0_zero_parameter_and_second_derivatives(kernels):
    """``sin0_zero`` on every path that does not go through the force-step kernels:
    parameter gradients (recomputed cohorts), the linears' own path, and a second
    derivative, equal to the reference on the zeroed column in float64."""
    x, ws, bs, wo, bo = _stack_args(40, F=32, Fo=16, n_ang=3, K=2)
    params = [*x, *ws, *bs, wo, bo]
    fn = functools.partial(cohorts.mixing_stack, kernels=kernels, cohort_edges=16,
                           sin0_zero=True)  # fmt: skip

    def grads(f, create_graph=False):
        y = f(*x, ws, bs, wo, bo)
        g = torch.Generator().manual_seed(5)
        gy = [torch.randn(t.shape, generator=g, dtype=t.dtype) for t in y]
        return torch.autograd.grad(y, params, gy, create_graph=create_graph)

    for a, b in zip(grads(fn), grads(_reference_sin0), strict=True):
        assert rel_err(a, b) < 1e-12
    (dxc, *_), (rxc, *_) = grads(fn, True), grads(_reference_sin0, True)
    v = torch.randn_like(dxc)
    for a, b in zip(torch.autograd.grad((dxc * v).sum(), params, allow_unused=True),
                    torch.autograd.grad((rxc * v).sum(), params, allow_unused=True),
                    strict=True):  # fmt: skip
        assert (a is None) == (b is None) and (a is None or rel_err(a, b) < 1e-12)


@needs_triton
def test_layers_strided_inputs():
    """Rows with any strides (a slice of a wider tensor, a transposed view) give what
    contiguous rows give, in float64."""
    x, *args = _fused_args(37, 2, 3, True)
    wide = torch.randn(37, 32, 5, dtype=torch.float64)
    xc = wide[..., 1:4].requires_grad_()  # strides (160, 5, 1)
    xs = x[1].detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()
    got = _fwd_and_force_bwd(lambda *a: cohorts.mixing_stack(*a, kernels="layers"),
                             [xc, xs], *args)  # fmt: skip
    ref = _fwd_and_force_bwd(reference.mixing_stack, [xc, xs], *args)
    for a, b in zip(got, ref, strict=True):
        assert rel_err(a, b) < 1e-12


def _as_planes_pair(t_cos, t_sin):
    """Copies of rows ``(E, W, n_ang)`` as the cos and sin views of one ``(n_ang,
    2, E, W)`` tensor (chapter 3's ``planes=True`` layout)."""
    P, a, b = planes_pair(t_cos, *t_cos.shape)
    a.copy_(t_cos.detach()), b.copy_(t_sin.detach())
    return a, b


@needs_triton
@pytest.mark.parametrize("recompute", [False, True], ids=["keep_z", "recompute"])
@pytest.mark.parametrize("sin0", [False, True], ids=["all", "sin0"])
def test_layers_planes_pairs_in_place(recompute, sin0):
    """Rows that are a planes pair (views of one ``(n_ang, 2, E, F)``) are read in
    place and the outputs and dx come as planes pairs, with the same values as
    contiguous rows bit for bit (the same products; only the copies are gone),
    the m = 0 sin planes zero with ``sin0_zero``; 37 rows in cohorts of 16. A
    planes x with a contiguous output gradient gives contiguous dx."""
    x, *args = _fused_args(37, 2, 3, True)
    fn = functools.partial(cohorts.mixing_stack, kernels="layers", cohort_edges=16,
                           recompute=recompute, sin0_zero=sin0)  # fmt: skip
    xp = [t.requires_grad_() for t in _as_planes_pair(*x)]
    y_rows, y_planes = fn(*x, *args), fn(*xp, *args)
    assert as_planes(*y_planes) is not None
    assert as_planes(*y_rows) is None
    g = [torch.randn_like(t) for t in y_rows]
    gp = _as_planes_pair(*g)
    d_rows = torch.autograd.grad(y_rows, x, g)
    d_planes = torch.autograd.grad(y_planes, xp, gp, retain_graph=True)
    assert as_planes(*d_planes) is not None
    for a, b in zip([*y_planes, *d_planes], [*y_rows, *d_rows], strict=True):
        assert torch.equal(a, b)
    if sin0:
        assert not y_planes[1][..., 0].any() and not d_planes[1][..., 0].any()
    d_mixed = torch.autograd.grad(y_planes, xp, g)
    assert as_planes(*d_mixed) is None
    for a, b in zip(d_mixed, d_rows, strict=True):
        assert torch.equal(a, b)
    wide = torch.zeros(3, 3, 37, 32, dtype=torch.float64)  # planes with a gap
    assert as_planes(wide[:, 0].permute(1, 2, 0),
                     wide[:, 2].permute(1, 2, 0)) is not None  # fmt: skip
    assert as_planes(wide[:, 2].permute(1, 2, 0),
                     wide[:, 0].permute(1, 2, 0)) is None  # fmt: skip


class _CutToTF32(torch.autograd.Function):
    """fp32 values with the low 13 mantissa bits dropped, the gradient likewise (as
    the backward's products read their operands, like a cast's backward)."""

    @staticmethod
    def forward(ctx, t):
        return (t.view(torch.int32) & ~0x1FFF).view(torch.float32)

    @staticmethod
    def backward(ctx, g):
        return (g.contiguous().view(torch.int32) & ~0x1FFF).view(torch.float32)


def _operands_at(precision):
    """The reference's linear with its operands as the tensor cores read them, for
    the three-way rule at TF32 and bf16: fp32 values cut to TF32 (the low 13 bits
    dropped, the larger error of truncation and rounding) or rounded to bfloat16,
    products and sums in the rows' dtype (fp32 accumulation, as the kernels)."""
    if precision == "tf32":
        cut = _CutToTF32.apply
    elif precision == "bf16":  # (its backward rounds the gradient to bf16 too)

        def cut(t):
            return t.to(torch.bfloat16).to(t.dtype)
    else:
        return reference.equivariant_linear

    def linear(x_cos, x_sin, weight, bias):
        return reference.equivariant_linear(cut(x_cos), cut(x_sin), cut(weight), bias)

    return linear


@needs_triton
@pytest.mark.parametrize("precision", PRECISIONS)
def test_layers_float32_against_float64(precision):
    """The three-way rule at every precision, the reference's operands cut to the
    precision's (:func:`_operands_at`; the interpreter computes tf32 in full fp32
    and emulates bf16's rounding)."""
    x64, *a64 = _fused_args(45, 2, 3, True)
    ref64 = _fwd_and_force_bwd(reference.mixing_stack, x64, *a64)
    x32, *a32 = _fused_args(45, 2, 3, True, dtype=torch.float32)
    ref32 = _fwd_and_force_bwd(
        lambda *a: reference.mixing_stack(*a, _operands_at(precision)), x32, *a32
    )  # fmt: skip
    got = _fwd_and_force_bwd(
        lambda *a: cohorts.mixing_stack(*a, kernels="layers", precision=precision),
        x32, *a32,
    )  # fmt: skip
    for out, r32, r64 in zip(got, ref32, ref64, strict=True):
        assert_close_three_way(out, r32, r64, f"layer kernels, {precision}")


def test_split_tf32_is_exact_and_rounds_to_nearest_even():
    """The weights' split for ``"tf32x3"``: hi has 10 mantissa bits, hi + lo is w
    exactly, |lo| is at most half a TF32 ulp of w, and ties go to the even hi;
    strided (transposed) weights split as their contiguous copy."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(3, 40, 24, generator=g) * torch.logspace(-8, 8, 24)
    w[0, 0, :4] = torch.tensor([0.0, -0.0, 1.0, -3.5])
    for t in (w, w.transpose(1, 2)):
        hi, lo = split_tf32(t)
        assert hi.shape == lo.shape == t.shape
        assert not (hi.view(torch.int32) & 0x1FFF).any()
        assert torch.equal(hi.double() + lo.double(), t.double())
        assert (lo.abs() <= t.abs() * 2.0**-11).all()
    one = 1.0 + 2.0**-10  # even mantissa below, odd above: ties to even
    ties = torch.tensor([1.0 + 2.0**-11, one + 2.0**-11, -(1.0 + 2.0**-11)])
    hi, _ = split_tf32(ties)
    assert hi.tolist() == [1.0, 1.0 + 2.0**-9, -1.0]


@needs_triton
def test_layers_weight_gradients_take_the_cohort_recomputation():
    """With the fused forward, a backward that asks for the weights' gradients too
    recomputes cohorts (the kernels make none): equal to the reference in float64."""
    x, ws, bs, wo, bo = _stack_args(40, F=32, Fo=16, n_ang=2, K=1)
    params = [*x, *ws, *bs, wo, bo]

    def grads(fn):
        y = fn(*x, ws, bs, wo, bo)
        g = torch.Generator().manual_seed(5)
        gy = [torch.randn(t.shape, generator=g, dtype=t.dtype) for t in y]
        return torch.autograd.grad(y, params, gy)

    got = grads(functools.partial(cohorts.mixing_stack, kernels="layers",
                                  cohort_edges=16))  # fmt: skip
    for a, b in zip(got, grads(reference.mixing_stack), strict=True):
        assert rel_err(a, b) < 1e-12


_COMPILE_STACK = """
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
import sys
from ecekern._triton import gluon
if gluon is None:
    sys.exit(77)
from ecekern.stack_fused import backward_kernel, forward_kernel, ring
assert tuple(ring.BK) == ("ieee", "tf32", "tf32x3", "bf16")  # the kernels' names
for prec in ring.BK:
    bk = ring.BK[prec]
    dt, name = (gl.bfloat16, "bf16") if prec == "bf16" else (gl.float32, "fp32")
    box = gl.NVMMASharedLayout.get_default_for([64, bk], dt)
    desc = f"tensordesc<{name}[64, {bk}],{box!r}>"
    for kernel, c in (
            (forward_kernel._fused_fwd_kernel,
             dict(K=2, HAS_B=True, HAS_BO=True, SLAB=False)),
            (forward_kernel._fused_fwd_kernel,
             dict(K=2, HAS_B=False, HAS_BO=True, SLAB=True)),
            (backward_kernel._fused_bwd_kernel, dict(K=2, RECOMP=False, HAS_B=False)),
            (backward_kernel._fused_bwd_kernel, dict(K=2, RECOMP=True, HAS_B=True))):
        c |= dict(SIN0=True, X3=prec == "tf32x3", FMA=prec == "ieee", BK=bk,
                  STG=ring.STAGES, num_warps=forward_kernel.WARPS)
        names = kernel.arg_names
        sig = {n: "constexpr" if n in c else desc if n.endswith("desc")
               else "*fp32" if n.endswith("ptr") else "i32" for n in names}
        src = GluonASTSource(fn=kernel, signature=sig,
                             constexprs={(names.index(k),): v for k, v in c.items()})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=forward_kernel.WARPS))
        ptx = k.asm["ptx"]
        n = ptx.count("wgmma.mma_async")
        want = {"ieee": 0, "tf32": 50, "tf32x3": 150, "bf16": 25}[prec]
        if c.get("RECOMP"):  # the gated layers' forward, then the backward
            want = {"ieee": 0, "tf32": 100, "tf32x3": 300, "bf16": 50}[prec]
        assert n >= want and (n == 0) == (prec == "ieee"), (prec, kernel, n)
        if prec == "ieee":  # strict fp32: FMAs, and no tensor-core products
            fmas = 12000 if c.get("RECOMP") else 6000
            assert ptx.count("fma.rn.f32") >= fmas, (kernel, ptx.count("fma.rn.f32"))
        elif prec == "bf16":
            assert "bf16.bf16" in ptx, kernel
        assert k.metadata.shared <= 227 * 1024, (prec, kernel, k.metadata.shared)
"""

_COMPILE = """
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ecekern.stack_layers import kernels as layers
for prec in ("tf32x3", "bf16"):
    BE, BN, BK, warps, stages = layers.TILES[prec]
    for kernel, flags in (
            (layers._layer_fwd_kernel, dict(GATE=True, HAS_B=True, KEEP=True)),
            (layers._layer_bwd_kernel, dict(RES=True, GATE=True))):
        flags["SIN0"] = True
        names = kernel.arg_names
        c = dict(KIN=192, NOUT=192, NA=3, BE=BE, BN=BN, BK=BK, PREC=prec,
                 DT=tl.float32, **flags)
        sig = {n: "constexpr" if n in c else "*fp32" if n in "a w b z o d r u dz"
               else "i32" for n in names}
        src = ASTSource(fn=kernel, signature=sig,
                        constexprs={(names.index(k),): v for k, v in c.items()})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=warps, num_stages=stages))
        assert "wgmma.mma_async" in k.asm["ptx"], (prec, kernel)
"""


@pytest.mark.skipif(not TRITON_AVAILABLE, reason="Triton is not installed")
def test_layer_kernels_compile_for_hopper():
    """The interpreter runs code that the compiler rejects (a constexpr assigned in
    an unrolled loop once did): both kernels compile for sm_90 here, without a GPU,
    in a process where the interpreter is off, to Hopper's wgmma at tf32x3 and
    bf16."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run(
        [sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]


@pytest.mark.skipif(not TRITON_AVAILABLE, reason="Triton is not installed")
def test_stack_kernels_compile_for_hopper():
    """The fused stack's Gluon kernels (no interpreter runs them) compile for
    sm_90 here, without a GPU, at every precision: to ``wgmma`` on the tensor cores
    (bf16 operands in bf16), to FMAs alone in strict fp32, within the 227 KB of
    shared memory a program may have."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run(
        [sys.executable, "-c", _COMPILE_STACK], env=env, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    if p.returncode == 77:
        pytest.skip("no validated Gluon in this Triton")
    assert p.returncode == 0, p.stderr[-3000:]


@needs_triton
def test_layer_kernels_reject_bad_inputs_before_launch():
    """The launchers check every shape a kernel indexes by: a mismatch is a clear
    ValueError, never an out-of-bounds read."""
    x, ws, bs, wo, bo = _fused_args(5, 2, 3, True)
    xc, xs = (t.detach() for t in x)
    z = torch.zeros(2, 3, 2, 5, 32, dtype=torch.float64)
    gc, gs = (torch.zeros(5, 16, 3, dtype=torch.float64) for _ in range(2))
    fwd, bwd = stack_layers.stack_forward, stack_layers.stack_backward
    cases = [
        (lambda: fwd(xc[:, :16], xs, ws, bs, wo, bo), "x_cos"),
        (lambda: fwd(xc, xs[:4], ws, bs, wo, bo), "x_sin"),
        (lambda: fwd(xc, xs, [ws[0], ws[1][:2]], bs, wo, bo), "weights"),
        (lambda: fwd(xc, xs, ws, bs, wo[..., :16], bo), "F = 16, from weight_out"),
        (lambda: fwd(xc, xs, ws, bs[:1], wo, bo), "biases"),
        (lambda: fwd(xc, xs, ws, bs, wo, bo[:3]), "bias"),
        (lambda: bwd(z[:, :, :, :4], gc, gs, ws, wo), "z"),
        (lambda: fwd(xc, xs, ws, bs, wo, bo, "fp32", 0), "cohort_edges"),
        (lambda: bwd(z, gc, gs[:, :8], ws, wo), "g_sin"),
        (lambda: bwd(z, gc, gs, ws[:1], wo), "weights"),
        (lambda: bwd(z, gc, gs, ws, torch.zeros_like(wo).repeat(1, 2, 1)), "g_cos"),
        (lambda: fwd(xc, xs, ws, bs, wo[:, :8], bo), "multiples of 16"),
        (lambda: fwd(xc, xs, ws, bs, wo[0], bo), "weight_out"),
        (lambda: fwd(xc, xs, ws, bs, wo, bo, "tf32"), "float64 takes"),
        (lambda: fwd(xc, xs, ws, bs, wo, bo, "fp8"), "precision"),
        (lambda: fwd(xc, xs, ws, bs, wo, bo, "ieee"), "precision"),  # a kernel name
    ]
    for call, name in cases:
        with pytest.raises(ValueError, match=name):
            call()
    with pytest.raises(TypeError, match="dtype"):  # the linears' rule: no casts
        bwd(z, gc, gs, ws, wo.float())
    with pytest.raises(TypeError, match="bias_out has dtype"):
        fwd(xc, xs, ws, bs, wo, bo.float())
    with pytest.raises(ValueError, match=r"biases\[1\] is \(5,\)"):
        fwd(xc, xs, ws, [bs[0], bo.new_zeros(5)], wo, bo)
    with pytest.raises(ValueError, match="contiguous"):
        bwd(z.transpose(3, 4).contiguous().transpose(3, 4), gc, gs, ws, wo)
    rec = stack_layers.stack_recompute_backward
    with pytest.raises(ValueError, match="weight_out has n_ang = 2"):
        bwd(z, gc, gs, ws, wo[:2])
    with pytest.raises(TypeError, match="z has dtype"):  # z, not the weights
        bwd(z.float(), gc, gs, ws, wo)
    with pytest.raises(TypeError, match="keep=True"):  # stack_forward(keep=False)
        bwd(None, gc, gs, ws, wo)
    with pytest.raises(TypeError, match="g_cos"):
        bwd(z, list(gc), gs, ws, wo)
    for flag in (2, 1, None, "yes"):  # 2 would skip a plane the kernels then read
        with pytest.raises(TypeError, match="sin0_zero"):
            fwd(xc, xs, ws, bs, wo, bo, sin0_zero=flag)
        with pytest.raises(TypeError, match="sin0_zero"):
            rec(xc, xs, gc, gs, ws, bs, wo, sin0_zero=flag)
    with pytest.raises(TypeError, match="biases must be a list"):
        rec(xc, xs, gc, gs, ws, None, wo)
    with pytest.raises(TypeError, match="biases must be a list"):
        cohorts.mixing_stack(xc, xs, ws, None, wo, bo)
    y = fwd(xc, xs, ws, bs, wo, bo, "fp32", np.int64(3))  # any integer cohort
    assert torch.equal(y[0], fwd(xc, xs, ws, bs, wo, bo, "fp32", 3)[0])


def test_the_plan_chooses_the_stack():
    """``"auto"``: the layer kernels in 3xTF32 for float32 on CUDA (keeping z or
    recomputing), the linears otherwise (float64, the CPU); a named stack and
    precision are used where they can serve."""
    shapes = ecekern.plan.Shapes(2, 2, 32, 2)

    def plan(device, dtype, **opts):
        cap = (9, 0) if device == "cuda" else None
        return ecekern.plan.resolve(device, cap, dtype, False, shapes,
                                    options.Options(**opts))  # fmt: skip

    got = plan("cuda", torch.float32)
    assert (got.stack, got.precision, got.memory) == ("layers", "3xtf32", "keep")
    assert plan("cuda", torch.float32, memory="recompute").precision == "3xtf32"
    assert plan("cuda", torch.float64).stack == "linears"
    assert plan("cpu", torch.float32).stack == "linears"
    got = plan("cuda", torch.float64, stack="layers")
    assert (got.stack, got.precision, got.memory) == ("layers", "fp64", "keep")
    assert plan("cuda", torch.float32, stack="linears").precision == "fp32"


def test_fused_cannot_serve_falls_back_loudly():
    """A shape, dtype or precision the kernel cannot serve runs the linears instead,
    with a FallbackWarning; a precision that is not one, or a sin0_zero that is not
    a bool, is an error. On the device the kernels run on (CUDA, else the
    interpreter's CPU), so that the reason is the call's and not the device's."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if stack_layers.why_not("fp32", dev, torch.float32, 32, 16):
        pytest.skip("Triton (or its interpreter) is not available")

    def on_dev(x, ws, bs, wo, bo):
        x = [t.detach().to(dev).requires_grad_() for t in x]
        bs = [None if b is None else b.to(dev) for b in bs]
        return x, [w.to(dev) for w in ws], bs, wo.to(dev), bo.to(dev)

    options.reset_fallback_warnings()
    x, *args = on_dev(*_fused_args(9, 1, 2, True, F=24, Fo=12))  # 24, 12: not 16k
    ref = reference.mixing_stack(*x, *args)
    with pytest.warns(options.FallbackWarning, match="multiples of 16"):
        y = cohorts.mixing_stack(*x, *args, kernels="layers")
    assert all(rel_err(a, b) < 1e-12 for a, b in zip(y, ref, strict=True))
    x, *args = on_dev(*_fused_args(9, 1, 2, True))
    with pytest.warns(options.FallbackWarning, match="precision"):  # float64
        cohorts.mixing_stack(*x, *args, kernels="layers", precision="tf32")
    for bad in ("fp8", "IEEE", "ieee", "off", "", True, ["fp32"], None):
        with pytest.raises(ValueError, match="precision must be"):  # not a precision
            cohorts.mixing_stack(*x, *args, kernels="layers", precision=bad)
        with pytest.raises(ValueError, match="precision must be"):  # nor with linears
            cohorts.mixing_stack(*x, *args, precision=bad)
    for bad in ("fp8", "ieee", "off", "", "stack", True, ["layers"]):  # no kernels
        with pytest.raises(ValueError, match="kernels must be"):
            cohorts.mixing_stack(*x, *args, kernels=bad)
        with pytest.raises(ValueError, match="kernels must be"):
            cohorts.why_not(bad, "fp32", "cpu", None, torch.float32, 32, 16, 3)
    with pytest.raises(TypeError, match="sin0_zero"):
        cohorts.mixing_stack(*x, *args, kernels="layers", sin0_zero=1)


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", cohorts.KERNELS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_gpu_layers_three_way(kernels, precision):
    """The book's widths (F = 192, F' = 96, n_ang = 3, K = 2) on CUDA, in cohorts of
    2048 rows with a tail tile, by the layer kernels and the fused stack; the
    three-way rule, the reference's operands cut to the precision's
    (:func:`_operands_at`: 3xTF32 against strict fp32)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    x64, *a64 = _fused_args(5003, 2, 3, True, F=192, Fo=96)
    x64 = [t.detach().cuda().requires_grad_() for t in x64]
    a64 = [None if t is None else ([u.cuda() for u in t] if isinstance(t, list)
           else t.cuda()) for t in a64]  # fmt: skip
    ref64 = _fwd_and_force_bwd(reference.mixing_stack, x64, *a64)
    x32 = [t.detach().float().requires_grad_() for t in x64]
    a32 = [[u.float() for u in t] if isinstance(t, list) else t.float() for t in a64]
    strict, torch.backends.cuda.matmul.allow_tf32 = (
        torch.backends.cuda.matmul.allow_tf32,
        False,
    )  # the reference's fp32 products in fp32, its operands cut by _operands_at
    try:
        ref32 = _fwd_and_force_bwd(
            lambda *a: reference.mixing_stack(*a, _operands_at(precision)),
            x32, *a32,
        )  # fmt: skip
    finally:
        torch.backends.cuda.matmul.allow_tf32 = strict
    options.reset_fallback_warnings()
    with warnings.catch_warnings():
        warnings.simplefilter("error", options.FallbackWarning)  # the kernels serve it
        got = _fwd_and_force_bwd(
            lambda *a: cohorts.mixing_stack(*a, kernels=kernels, precision=precision,
                                            cohort_edges=2048),
            x32, *a32,
        )  # fmt: skip
    for out, r32, r64 in zip(got, ref32, ref64, strict=True):
        assert_close_three_way(out, r32, r64, f"{kernels} on CUDA, {precision}")


def _planes_rows(E, W, dev, seed, nan_sin0):
    """Rows that are a planes pair ``(E, W, 3)`` (chapter 3's hand-over), their
    m = 0 sin plane NaN when it must not be read."""
    g = torch.Generator().manual_seed(seed)
    P = torch.randn(3, 2, E, W, generator=g, dtype=torch.float64).to(dev)
    if nan_sin0:
        P[0, 1] = float("nan")
    return P.float()


@pytest.mark.gpu
@pytest.mark.parametrize("E", [1, 31, 33, 8193])
@pytest.mark.parametrize("recompute", [False, True], ids=["keep_z", "recompute"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_gpu_stack_on_planes_pairs(E, recompute, precision):
    """The model's call of the fused stack: rows that are a planes pair, sin0_zero
    (the m = 0 sin plane NaN: never read), one cohort and a tail tile; forward and
    force backward, kept z and recomputing, against the fp64 reference by the
    three-way rule at the stack's precision; y and dx handed out as planes pairs,
    their m = 0 sin planes zero."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _, ws, bs, wo, bo = _fused_args(1, 2, 3, True, F=192, Fo=96)
    ws, bs = [w.cuda() for w in ws], [b.cuda() for b in bs]
    wo, bo = wo.cuda(), bo.cuda()
    X = _planes_rows(E, 192, "cuda", 1, True)
    G = _planes_rows(E, 96, "cuda", 2, True)
    rows = lambda P: (P[:, 0].permute(1, 2, 0), P[:, 1].permute(1, 2, 0))  # noqa: E731
    f32 = [[w.float() for w in ws], [b.float() for b in bs], wo.float(), bo.float()]
    kw = {"sin0_zero": True, "cohort_edges": 4096}
    options.reset_fallback_warnings()
    with warnings.catch_warnings():
        warnings.simplefilter("error", options.FallbackWarning)
        y_cos, y_sin, z = stack_fused.stack_forward(
            *rows(X), *f32, precision, keep=not recompute, **kw
        )  # fmt: skip
        if recompute:
            dx = stack_fused.stack_recompute_backward(
                *rows(X), *rows(G), f32[0], f32[1], f32[2], precision, **kw
            )  # fmt: skip
        else:
            dx = stack_fused.stack_backward(z, *rows(G), f32[0], f32[2], precision,
                                            **kw)  # fmt: skip
    assert as_planes(y_cos, y_sin) is not None
    assert as_planes(*dx) is not None
    for t in (y_sin, dx[1]):
        assert torch.equal(t[..., 0], torch.zeros_like(t[..., 0]))

    def ref(dtype, linear):
        x = [t.to(dtype).clone() for t in rows(torch.nan_to_num(X))]
        x[1][..., 0] = 0
        x = [t.requires_grad_() for t in x]
        g = [t.to(dtype).clone() for t in rows(torch.nan_to_num(G))]
        g[1][..., 0] = 0
        p = [[w.to(dtype) for w in ws], [b.to(dtype) for b in bs], wo.to(dtype),
             bo.to(dtype)]  # fmt: skip
        y = reference.mixing_stack(*x, *p, linear)
        return (*y, *torch.autograd.grad(y, x, g))

    ref64 = ref(torch.float64, reference.equivariant_linear)
    strict, torch.backends.cuda.matmul.allow_tf32 = (
        torch.backends.cuda.matmul.allow_tf32, False,
    )  # fmt: skip
    try:
        ref32 = ref(torch.float32, _operands_at(precision))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = strict
    for out, r32, r64 in zip((y_cos, y_sin, *dx), ref32, ref64, strict=True):
        assert_close_three_way(out, r32, r64, f"fused {precision}, E = {E}")


@needs_triton
@pytest.mark.parametrize("precision", PRECISIONS)
def test_stack_falls_back_to_the_layer_kernels_loudly(precision):
    """The fused stack where its kernels cannot serve (here: not CUDA, or widths
    other than the book's) runs the layer kernels at its precision, with a
    FallbackWarning that says why, and gives their result bit for bit, forward and
    force backward; its own launchers refuse the call with the reason."""
    x, ws, bs, wo, bo = _fused_args(37, 2, 3, True, dtype=torch.float32)
    g = [torch.randn(37, 16, 3) for _ in range(2)]

    def run(kernels):
        xs = [t.detach().requires_grad_() for t in x]
        y = cohorts.mixing_stack(*xs, ws, bs, wo, bo, kernels=kernels,
                                 precision=precision, cohort_edges=16)  # fmt: skip
        return (*y, *torch.autograd.grad(y, xs, g))

    options.reset_fallback_warnings()
    with pytest.warns(options.FallbackWarning,
                      match=rf"fused {precision}.*(CUDA|192|Gluon)"):  # fmt: skip
        got = run("fused")
    with warnings.catch_warnings():
        warnings.simplefilter("error", options.FallbackWarning)  # the layers serve
        ref = run("layers")
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="fused stack cannot serve.*(CUDA|192|Gluon)"):
        stack_fused.stack_forward(*[t.detach() for t in x], ws, bs, wo, bo, precision)


def test_stack_why_not_and_z_layout():
    """What the fused kernels serve, said before any launch; a z that is not a
    cohort's rows of a contiguous ``(K, 3, 2, E, F)`` is a ValueError."""
    from ecekern.stack_fused import launch

    def why(F, FO, n_ang, dtype, dev, prec, cap=None):
        got = stack_fused.why_not(prec, dev, cap, dtype, F, FO, n_ang)
        fused = cohorts.why_not("fused", prec, dev, cap, dtype, F, FO, n_ang)
        assert got == fused  # one answer, whoever asks
        return got

    dev = "cuda"
    for cap in ((8, 0), (10, 0), (12, 0)):  # Ampere, Blackwell: not the kernels'
        assert f"sm_{cap[0]}0" in why(192, 96, 3, torch.float32, dev, "tf32", cap)
    assert "CUDA" in why(192, 96, 3, torch.float32, "cpu", "3xtf32", None)
    if stack_fused.gluon is None:  # (Triton's interpreter on, or another release)
        assert why(192, 96, 3, torch.float32, dev, "tf32") == stack_fused.GLUON_REASON
    else:
        assert why(192, 96, 3, torch.float32, dev, "tf32") is None
        assert why(192, 96, 3, torch.float32, dev, "tf32", (9, 0)) is None
        assert "CUDA" in why(192, 96, 3, torch.float32, "cpu", "tf32")
        assert "float32" in why(192, 96, 3, torch.float64, dev, "tf32")
        for prec in ("fp32", "3xtf32", "bf16"):
            assert why(192, 96, 3, torch.float32, dev, prec) is None
        with pytest.raises(ValueError, match="precision"):  # the kernels' own name
            cohorts.why_not("fused", "ieee", dev, None, torch.float32, 192, 96, 3)
        assert "192" in why(128, 64, 3, torch.float32, dev, "tf32")
    assert cohorts.why_not(None, "tf32", "cpu", None, torch.float16, 5, 3, 1) is None
    xp = torch.zeros(3, 2, 5, 192)
    ws, wo = [torch.zeros(3, 192, 192)], torch.zeros(3, 96, 192)
    rows = torch.zeros(5, 192, 3)
    with pytest.raises(ValueError, match="cannot serve.*CUDA"):  # public, so checked
        stack_fused.stack_forward(rows, rows, ws, [None], wo, None, "3xtf32")
    with pytest.raises(TypeError, match="float32"):
        split_tf32(torch.zeros(3, 4, 4, dtype=torch.float64))
    big = torch.empty(3, 2, 11_200_000, 192, device="meta")  # 2**31 values a plane
    near = torch.empty(3, 2, 11_150_000, 192, device="meta")  # sin part + rows: over
    for bad, n in ((big, 11_200_000), (near[:, :, :65536], 65536)):
        with pytest.raises(ValueError, match="fewer than 2"):
            launch._check_planes(n, x=(bad, 192))
    with pytest.raises(ValueError, match="not the fused stack's planes"):
        launch._check_planes(7, x=(torch.zeros(3, 2, 8, 192), 192))
    gp, dxp = torch.zeros(3, 2, 5, 96), torch.zeros(3, 2, 5, 192)
    kept, recomputing = ((None, None), (None, None), 2, "tf32"), (
        (None, None), (None, None), None, 2, "tf32")  # fmt: skip
    z1 = torch.zeros(1)  # (never read: the arguments disagree first)
    for prep, z, x in ((kept, None, xp), (recomputing, z1, None), (kept, None, None),
                       (recomputing, None, None)):  # fmt: skip
        with pytest.raises(ValueError, match="kept z, or x"):
            launch.backward(gp, prep, z, dxp, False, x)
    ok = torch.empty(3, 2, 5_000_000, 192, device="meta")
    launch._check_planes(5, x=(ok[:, :, 5:10], 192))  # a cohort's rows of it
    zbig = torch.empty(2, 3, 2, 2_500_000, 192, device="meta")  # 6 E F > 2**31: fine
    assert launch._z_plane(zbig[:, :, :, :100], 2, 100) == 2_500_000 * 192
    z = torch.empty(2, 3, 2, 100, 192)
    assert launch._z_plane(z[:, :, :, 10:50], 2, 40) == 100 * 192
    for bad in (z.transpose(3, 4)[..., :192, :100], torch.empty(2, 3, 2, 40, 192)[:1]):
        with pytest.raises(ValueError, match="cohort's rows"):
            launch._z_plane(bad, 2, 40)


@pytest.mark.parametrize("planes", [True, False], ids=["planes", "copied_rows"])
def test_stack_dispatch_keep_and_recompute(monkeypatch, planes):
    """Without a GPU: what the fused stack's cohort launchers hand the tile
    launchers, the kernels replaced by the tile launchers' own checks. Keeping z,
    the forward gets a cohort's z and the backward reads it; recomputing, the
    forward gets no z (y only) and the backward gets x instead; every planes tensor
    passes the launchers' index checks."""
    from ecekern.stack_fused import launch

    calls = []

    def forward(xp, prep, z, yp, sin0):
        n = xp.shape[2]
        launch._check_planes(n, x=(xp, 192), y=(yp, 96))
        if z is not None:
            launch._z_plane(z, 2, n)
        calls.append(("forward", n, z is not None))

    def backward(gp, prep, z, dxp, sin0, xp=None):
        n = gp.shape[2]
        x = {} if xp is None else {"x": (xp, 192)}
        launch._check_planes(n, dy=(gp, 96), dx=(dxp, 192), **x)
        if z is not None:
            launch._z_plane(z, 2, n)
        calls.append(("backward", n, z is not None, xp is not None))

    monkeypatch.setattr(stack_fused, "why_not", lambda *a: None)  # as on an H200
    for name, fn in (("forward", forward), ("backward", backward),
                     ("forward_weights", lambda *a: None),
                     ("backward_weights", lambda *a: None)):  # fmt: skip
        monkeypatch.setattr(stack_fused, name, fn)
    _, ws, bs, wo, _ = _fused_args(1, 2, 3, True, dtype=torch.float32, F=192, Fo=96)
    X = _planes_rows(5003, 192, "cpu", 1, False)
    G = _planes_rows(5003, 96, "cpu", 2, False)
    x = (X[:, 0].permute(1, 2, 0), X[:, 1].permute(1, 2, 0))
    g = (G[:, 0].permute(1, 2, 0), G[:, 1].permute(1, 2, 0))
    if not planes:
        x, g = [t.contiguous() for t in x], [t.contiguous() for t in g]
    kw = {"cohort_edges": 2048, "sin0_zero": True}
    z = stack_fused.stack_forward(*x, ws, bs, wo, None, "tf32", **kw)[2]
    stack_fused.stack_backward(z, *g, ws, wo, "tf32", **kw)
    assert calls == [("forward", n, True) for n in (2048, 2048, 907)] + [
        ("backward", n, True, False) for n in (2048, 2048, 907)]  # fmt: skip
    calls.clear()
    y = stack_fused.stack_forward(*x, ws, bs, wo, None, "tf32", keep=False, **kw)
    assert y[2] is None
    stack_fused.stack_recompute_backward(*x, *g, ws, bs, wo, "tf32", **kw)
    assert calls == [("forward", n, False) for n in (2048, 2048, 907)] + [
        ("backward", n, False, True) for n in (2048, 2048, 907)]  # fmt: skip


@pytest.mark.gpu
def test_gpu_physics_with_the_layer_kernels(monkeypatch):
    """What an MD user checks, with the stack on the layer kernels on CUDA, in
    float64 (their ``"fp32"`` precision: the reference's arithmetic, so the tests'
    bounds are the CPU's): the energy and forces are continuous across the cutoff,
    and velocity Verlet's energy error over the same 100 fs scales as dt^2 (a ratio
    of about 4 between 1 and 0.5 fs) while pairs cross the cutoff."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import numpy as np
    from ase import Atoms, units
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution
    from ase.md.verlet import VelocityVerlet

    from ecekern.calculator import ECECalculator
    from ecekern.graph import build_graph

    calls = []
    real = stack_layers.stack_forward

    def spy(*args, **kw):
        calls.append(args[0].shape[0])
        return real(*args, **kw)

    monkeypatch.setattr(stack_layers, "stack_forward", spy)
    cfg = ecekern.ECEConfig(channels=16, radial_hidden=16, readout_hidden=8,
                            n_gated=2, cutoff=3.0)  # fmt: skip
    torch.manual_seed(0)
    model = ecekern.ECEModel(cfg).double()
    calc = ECECalculator(model, device="cuda", graph_step=False)  # eager: spied
    with options.use(memory="keep", stack="layers", cohort_edges=1000):
        rc = cfg.cutoff
        for n_atoms in (2, 3):
            ef = []
            for r in (rc - 1e-4, rc + 1e-4):
                pos = [[0.0, 0.0, 0.0], [r, 0.0, 0.0], [-0.6, 1.15, 0.0]][:n_atoms]
                atoms = Atoms(numbers=[6, 6, 8][:n_atoms], cell=[30.0] * 3,
                              positions=np.array(pos) + 10.0, pbc=False)  # fmt: skip
                atoms.calc = calc
                ef.append((atoms.get_potential_energy(), atoms.get_forces()))
            (e_in, f_in), (e_out, f_out) = ef
            assert abs(e_in - e_out) < 1e-10
            assert np.abs(f_in - f_out).max() < 1e-8

        def edges(atoms):
            g = build_graph(atoms.positions, atoms.cell.array, atoms.pbc, rc)
            return set(zip(g.src.tolist(), g.dst.tolist(),
                           map(tuple, g.shifts.tolist())))  # fmt: skip

        def max_deviation(dt_fs):
            atoms = ecekern.systems.diamond(repeats=2, rattle=0.05, seed=0)
            MaxwellBoltzmannDistribution(atoms, temperature_K=300,
                                         rng=np.random.default_rng(0))  # fmt: skip
            atoms.calc = calc
            first, e0, dev = edges(atoms), atoms.get_total_energy(), []
            dyn = VelocityVerlet(atoms, timestep=dt_fs * units.fs)
            dyn.attach(lambda: dev.append(abs(atoms.get_total_energy() - e0)))
            dyn.run(round(100 / dt_fs))
            assert edges(atoms) != first  # pairs crossed the cutoff
            return max(dev)

        dev_1, dev_half = max_deviation(1.0), max_deviation(0.5)
    assert calls, "the layer kernels did not run"
    assert dev_1 / 64 < 1e-6, dev_1
    assert 2.5 < dev_1 / dev_half < 6.0, (dev_1, dev_half)
