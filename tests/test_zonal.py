import pytest
import torch

import ecekern
from ecekern import options, reference, zonal
from ecekern._triton import INTERPRET
from ecekern.bench import cuda_graph
from ecekern.graph import csr_row_ptr
from ecekern.testing import assert_close_three_way, rel_err

# the fused op runs in the interpreter on CPU machines and on the GPU elsewhere: the
# same tests, on whichever device serves the kernels here
DEV = "cpu" if INTERPRET else "cuda"


def _inputs(E, N, L, C, dtype=torch.float64, seed=0, empty_nodes=()):
    g = torch.Generator().manual_seed(seed)
    nodes = torch.tensor([n for n in range(N) if n not in empty_nodes])
    dst = torch.sort(nodes[torch.randint(0, len(nodes), (E,), generator=g)]).values
    Z = torch.randn(E, (L + 1) ** 2 - 1, generator=g, dtype=torch.float64).to(dtype)
    R = torch.randn(E, L, C, generator=g, dtype=torch.float64).to(dtype)
    row_ptr = csr_row_ptr(dst, N)
    Z, R, dst, row_ptr = (t.to(DEV) for t in (Z, R, dst, row_ptr))
    return Z.requires_grad_(), R.requires_grad_(), dst, row_ptr


def _run(fn, Z, R, dst, row_ptr, scale=0.37, seed=1):
    h = fn(Z, R, dst, row_ptr, scale)
    G = torch.randn(
        h.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    ).to(h.device, h.dtype)
    dZ, dR = torch.autograd.grad(h, (Z, R), G)
    return h, dZ, dR


@pytest.mark.parametrize(
    "E, N, L, C",
    [
        (0, 3, 2, 4),
        (1, 1, 1, 1),
        (40, 7, 3, 17),
        (37, 5, 4, 3),
        (50, 6, 2, 48),
        (23, 4, 1, 100),
        (64, 9, 3, 32),
    ],
    ids=["no-edges", "one-edge", "C17", "L4-C3", "C48", "C100", "default"],
)
def test_fp64_matches_reference(E, N, L, C):
    args = _inputs(E, N, L, C)
    for got, ref in zip(
        _run(zonal.zonal_scatter, *args),
        _run(reference.zonal_scatter, *args),
        strict=True,
    ):
        assert got.shape == ref.shape
        assert rel_err(got, ref) < 1e-12
    h = zonal.zonal_scatter(*args, 0.37)
    assert h[:, 0].abs().max() == 0 if N else True


def test_nodes_without_edges():
    args = _inputs(30, 8, 2, 5, empty_nodes=(0, 3, 7))
    h, *_ = _run(zonal.zonal_scatter, *args)
    assert h[[0, 3, 7]].abs().max() == 0
    assert rel_err(h, reference.zonal_scatter(*args, 0.37)) < 1e-12


def test_fp32_three_way():
    args64 = _inputs(60, 7, 3, 19)
    args32 = [
        args64[0].detach().float().requires_grad_(),
        args64[1].detach().float().requires_grad_(),
        *args64[2:],
    ]
    truth = _run(reference.zonal_scatter, *args64)
    for got, ref32, t in zip(
        _run(zonal.zonal_scatter, *args32),
        _run(reference.zonal_scatter, *args32),
        truth,
        strict=True,
    ):
        assert_close_three_way(got, ref32, t, "zonal_scatter fp32")


def test_non_contiguous_and_sliced_inputs():
    Z, R, dst, row_ptr = _inputs(33, 6, 2, 7)
    big = torch.randn(33, 12, dtype=torch.float64, device=DEV)
    big[:, 1:9] = Z.detach()
    Zs = big[:, 1:9]
    Rt = R.detach().transpose(1, 2).contiguous().transpose(1, 2)
    assert not Zs.is_contiguous() and not Rt.is_contiguous()
    got = zonal.zonal_scatter(Zs, Rt, dst, row_ptr, 0.5)
    assert rel_err(got, reference.zonal_scatter(Z, R, dst, row_ptr, 0.5)) < 1e-12


def test_deterministic():
    args = _inputs(80, 5, 3, 9)
    a = _run(zonal.zonal_scatter, *args)
    b = _run(zonal.zonal_scatter, *args)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_gradcheck_and_gradgradcheck():
    Z, R, dst, row_ptr = _inputs(6, 3, 2, 3)
    f = lambda z, r: zonal.zonal_scatter(z, r, dst, row_ptr, 0.7)
    assert torch.autograd.gradcheck(f, (Z, R))
    assert torch.autograd.gradgradcheck(f, (Z, R), fast_mode=True)


def test_custom_ops_pass_opcheck_and_compile():
    Z, R, dst, row_ptr = _inputs(12, 4, 2, 5)
    args = (Z.detach(), R.detach(), dst, row_ptr, 0.5)
    G = torch.randn(4, 9, 5, dtype=Z.dtype, device=Z.device)
    # schema, fake implementation and AOT dispatch of both ops
    torch.library.opcheck(zonal._scatter_lib, args)
    torch.library.opcheck(zonal._gather_lib, (G, *args))
    # fullgraph: the public function must trace without a graph break (its CSR value
    # checks, which need host syncs, are skipped while tracing)
    f = torch.compile(
        lambda z, r: zonal.zonal_scatter(z, r, dst, row_ptr, 0.5),
        backend="aot_eager",
        fullgraph=True,
    )
    got = _run(lambda z, r, d, p, s: f(z, r), Z, R, dst, row_ptr)
    ref = _run(reference.zonal_scatter, Z, R, dst, row_ptr, 0.5)
    assert all(rel_err(a, b) < 1e-12 for a, b in zip(got, ref, strict=True))


@pytest.mark.parametrize(
    "change, err",
    [
        (lambda a: (a[0][:, :7],) + a[1:], ValueError),
        (lambda a: (a[0].float(),) + a[1:], TypeError),
        (lambda a: a[:2] + (a[2].int(),) + a[3:], TypeError),
        (lambda a: a[:2] + (a[2].flip(0),) + a[3:], ValueError),
        (lambda a: a[:3] + (a[3][:-1],), ValueError),
    ],
    ids=["Z-shape", "dtype", "dst-int32", "unsorted", "row_ptr"],
)
def test_bad_inputs_rejected_like_the_reference(change, err):
    Z, R, dst, row_ptr = _inputs(10, 4, 2, 3)
    args = change((Z.detach(), R.detach(), dst, row_ptr))
    with pytest.raises(err):
        reference.zonal_scatter(*args, 1.0)
    with pytest.raises(err):
        zonal.zonal_scatter(*args, 1.0)


def test_model_energy_forces_and_training_step_with_the_fused_op():
    cfg = ecekern.ECEConfig(channels=5, radial_hidden=8, readout_hidden=4, n_gated=1)
    atoms = ecekern.systems.diamond(1, rattle=0.1, seed=6)
    results = []
    for fused in (False, True):
        model = ecekern.ECEModel(cfg).to(DEV, torch.float64)
        with options.use(zonal="fused" if fused else "reference"):
            e, f = ecekern.energy_and_forces(model, atoms, create_graph=True)
            loss = (f**2).sum() + e**2
            loss.backward()
        results.append([e, f, loss] + [p.grad for p in model.parameters()])
    for a, b in zip(*results, strict=True):
        assert rel_err(a, b) < 1e-10


@pytest.mark.parametrize("L", [1, 2, 4])
@pytest.mark.parametrize("stages", [1, 3])
def test_launches_match_reference(L, stages):
    """The launchers compute the same thing at every launch chapter 5 measures: the
    CSR walk software-pipelined (stages > 1: loads in flight through shared memory on
    the GPU) or not, small and large register tiles. Launches are arguments."""
    Z, R, dst, row_ptr = _inputs(70, 6, L, 19, empty_nodes=(2,))
    for tile in (1024, 5120):
        launch = zonal.ZonalLaunch(fwd_tile=tile, fwd_stages=stages, bwd_tile=tile)
        h = zonal.zonal_scatter_fwd(Z.detach(), R.detach(), row_ptr, 0.37, launch)
        assert rel_err(h, reference.zonal_scatter(Z, R, dst, row_ptr, 0.37)) < 1e-12
        G = torch.randn_like(h)
        dz, dr = zonal.zonal_edge_gather(G, Z, R, dst, row_ptr, 0.37, launch)
        want = torch.autograd.grad(
            reference.zonal_scatter(Z, R, dst, row_ptr, 0.37), (Z, R), G
        )
        assert rel_err(dz, want[0]) < 1e-12 and rel_err(dr, want[1]) < 1e-12


@pytest.mark.parametrize("which", ["row_ptr", "dst", "both"])
def test_strided_index_tensors(which):
    """The stride contract: ``row_ptr`` and ``dst`` that are every other element of a
    larger tensor (a slice, as a batch of graphs would hand them over). Before the
    contract the fused forward read a strided row_ptr as contiguous (off by 5.6) and
    the gradient gather a strided dst (off by 2.0)."""
    Z, R, dst, row_ptr = _inputs(40, 7, 2, 5)

    def strided(t):
        big = torch.full((2 * t.shape[0],), -7, dtype=t.dtype, device=t.device)
        big[::2] = t
        return big[::2]

    d = strided(dst) if which in ("dst", "both") else dst
    p = strided(row_ptr) if which in ("row_ptr", "both") else row_ptr
    assert not (d.is_contiguous() and p.is_contiguous())
    for got, ref in zip(
        _run(zonal.zonal_scatter, Z, R, d, p),
        _run(reference.zonal_scatter, Z, R, dst, row_ptr),
        strict=True,
    ):
        assert rel_err(got, ref) < 1e-12


def test_fp64_scale_is_not_rounded_to_fp32():
    """Triton passes Python floats as fp32; 0.1 is not an fp32 number."""
    args = _inputs(50, 5, 2, 8)
    for got, ref in zip(
        _run(zonal.zonal_scatter, *args, scale=0.1),
        _run(reference.zonal_scatter, *args, scale=0.1),
        strict=True,
    ):
        assert rel_err(got, ref) < 1e-13


def test_unvalidated_bad_csr_never_reads_out_of_bounds():
    """validate=False skips the value checks; a CSR that points past the edges must
    still give finite numbers of the right shape (the kernels clamp), and the same
    call with validation must refuse it."""
    Z, R, dst, row_ptr = _inputs(20, 4, 2, 3)
    bad_ptr = row_ptr.clone()
    bad_ptr[-1] += 1000
    bad_dst = dst.clone()
    bad_dst[-1] = 1000
    with pytest.raises(ValueError):
        zonal.zonal_scatter(Z, R, bad_dst, bad_ptr, 1.0)
    h = zonal.zonal_scatter(Z, R, bad_dst, bad_ptr, 1.0, validate=False)
    assert h.shape == (4, 9, 3) and torch.isfinite(h).all()
    dZ, dR = torch.autograd.grad(h.sum(), (Z, R))
    assert torch.isfinite(dZ).all() and torch.isfinite(dR).all()


# ----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("L", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_gpu_larger_graphs_match_reference(dtype, tol, L):
    """Thousands of edges, many blocks per node, every degree."""
    args = _inputs(20_000, 150, L, 48, dtype=dtype)
    got = _run(zonal.zonal_scatter, *args)
    ref = _run(reference.zonal_scatter, *args)
    assert all(rel_err(a, b) < tol for a, b in zip(got, ref, strict=True))


@pytest.mark.gpu
def test_gpu_inductor_compile_matches_eager():
    """torch.compile (inductor) of the op, forward and gradients: guards the custom-op
    launch-grid trap (a grid computed from traced sizes)."""
    Z, R, dst, row_ptr = _inputs(3000, 37, 3, 32)
    f = lambda z, r: zonal.zonal_scatter(z, r, dst, row_ptr, 0.3)
    cf = torch.compile(f, fullgraph=True)
    a = _run(lambda z, r, d, p, s: f(z, r), Z, R, dst, row_ptr)
    b = _run(lambda z, r, d, p, s: cf(z, r), Z, R, dst, row_ptr)
    assert all(rel_err(x, y) < 1e-14 for x, y in zip(a, b, strict=True))
    # another graph size, compiled with dynamic shapes
    Z2, R2, dst2, row_ptr2 = _inputs(500, 11, 3, 32, seed=5)
    f2 = lambda z, r: zonal.zonal_scatter(z, r, dst2, row_ptr2, 0.3)
    cf2 = torch.compile(f2, fullgraph=True, dynamic=True)
    a = _run(lambda z, r, d, p, s: cf2(z, r), Z2, R2, dst2, row_ptr2)
    b = _run(lambda z, r, d, p, s: f2(z, r), Z2, R2, dst2, row_ptr2)
    assert all(rel_err(x, y) < 1e-14 for x, y in zip(a, b, strict=True))


@pytest.mark.gpu
def test_gpu_kernels_replay_in_a_cuda_graph():
    """The forward and the gather launch nothing the host must see (no syncs, no
    host copies): captured once in a CUDA graph, a replay gives the eager bits. This
    is what chapter 5's GPU times rely on, and what a molecular-dynamics loop needs."""
    Z, R, dst, row_ptr = (t.detach() for t in _inputs(5000, 70, 3, 32, torch.float32))
    G = torch.randn(70, 16, 32, device=DEV)
    args = (Z, R, dst, row_ptr, 0.1)
    eager = [zonal._scatter_op(*args), *zonal._gather_op(G, *args)]
    graph, out = cuda_graph(
        lambda: [zonal._scatter_op(*args), *zonal._gather_op(G, *args)]
    )
    for t in out:
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(out, eager, strict=True))


def test_the_reference_switch_reaches_the_model_through_the_plan():
    """``options.use(reference=True)`` makes the model's zonal stage the reference
    (the plan's); the public fused op reads no options and gives the same bits
    inside such a block."""
    Z, R, dst, row_ptr = _inputs(20, 4, 2, 3)
    h = zonal.zonal_scatter(Z, R, dst, row_ptr, 0.5)
    model = ecekern.ECEModel(ecekern.ECEConfig(channels=4, n_gated=1)).to(Z.device)
    with options.use(reference=True):
        assert torch.equal(zonal.zonal_scatter(Z, R, dst, row_ptr, 0.5), h)
        assert model.plan().zonal == "reference"
    with options.use(zonal="fused"):
        assert model.plan().zonal == "fused"  # on a CPU: the interpreter's
