"""The fused geometry (``ecekern.step.geometry``) against its reference composition
(``geometry_torch``: edge vectors, envelope, ``so3.edge_frames``, ``pack``, the zonal
rows): values, the positions' and the cell's gradients, second derivatives, tails,
bad inputs, and the generated tiles against their generator."""

import pytest
import torch

import ecekern
from ecekern._triton import INTERPRET
from ecekern.graph import Graph, build_graph, csr_row_ptr
from ecekern.step import geometry as G
from ecekern.testing import assert_close_three_way, rel_err

# the kernels run in the interpreter on CPU machines and on the GPU elsewhere
DEV = "cpu" if INTERPRET else "cuda"
VARIANTS = sorted(G.VARIANTS)
PAD = 7.5  # beyond every cutoff below


def _system(repeats=1, cutoff=3.0, dtype=torch.float64, seed=0):
    """A rattled diamond cell and its graph on DEV; the cell differentiable."""
    atoms = ecekern.systems.diamond(repeats, rattle=0.1, seed=seed)
    x = torch.tensor(atoms.positions, dtype=torch.float64)
    cell = torch.tensor(atoms.cell.array, dtype=torch.float64)
    g = build_graph(x, cell, [True] * 3, cutoff)
    g = Graph(g.src.to(DEV), g.dst.to(DEV), g.shifts.to(DEV), g.row_ptr.to(DEV),
              cell.to(DEV, dtype), cutoff=cutoff)  # fmt: skip
    return x.to(DEV, dtype), g


def _padded(x, g, per_atom=2):
    """``g`` with ``per_atom`` padding self-edges at every atom, as GraphStep
    stores a graph (dst-sorted, zero shifts, ``padded=True``)."""
    N = x.shape[0]
    atoms = torch.arange(N, device=DEV).repeat_interleave(per_atom)
    src = torch.cat([g.src, atoms])
    dst = torch.cat([g.dst, atoms])
    shifts = torch.cat([g.shifts, torch.zeros(len(atoms), 3, dtype=torch.long,
                                              device=DEV)])  # fmt: skip
    order = torch.sort(dst, stable=True).indices
    return Graph(src[order], dst[order], shifts[order], csr_row_ptr(dst[order], N),
                 g.cell, True, cutoff=g.cutoff)  # fmt: skip


def _with_cell(g, cell):
    return Graph(g.src, g.dst, g.shifts, g.row_ptr, cell, g.padded, cutoff=g.cutoff)


def _run(fn, x, g, L, M, seed=3):
    """``fn``'s (P, Z, d, env) and the gradients of a random projection of all four
    with respect to the positions and the cell."""
    x = x.detach().clone().requires_grad_()
    cell = g.cell.detach().clone().requires_grad_()
    outs = fn(x, _with_cell(g, cell), L, M, PAD)
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=gen, dtype=torch.float64)
                .to(o.device, o.dtype)).sum() for o in outs)  # fmt: skip
    return (*outs, *torch.autograd.grad(loss, (x, cell)))


NAMES = ("P", "Z", "d", "env", "dx", "dcell")


@pytest.mark.parametrize("L,M", VARIANTS)
def test_fp64_matches_the_reference_composition(L, M):
    x, g = _system()
    got = _run(G.geometry, x, g, L, M)
    want = _run(G.geometry_torch, x, g, L, M)
    for name, a, b in zip(NAMES, got, want, strict=True):
        assert a.shape == b.shape, name
        assert rel_err(a, b) < 1e-12, (L, M, name, rel_err(a, b))


@pytest.mark.parametrize("L,M", [(1, 1), (2, 2)])
def test_padded_graph_padding_edges_add_nothing(L, M):
    """Padding self-edges get the reference's values (a vector beyond the cutoff,
    envelope 0) and add exactly zero to both gradients."""
    x, g = _system()
    gp = _padded(x, g)
    got = _run(G.geometry, x, gp, L, M)
    want = _run(G.geometry_torch, x, gp, L, M)
    for name, a, b in zip(NAMES, got, want, strict=True):
        assert rel_err(a, b) < 1e-12, (name, rel_err(a, b))
    pad = gp.src == gp.dst
    assert torch.equal(got[3][pad], torch.zeros_like(got[3][pad]))
    assert torch.all(got[2][pad] == PAD)


def test_no_edges_and_one_edge():
    x, g = _system()
    for keep in (0, 1):
        sub = Graph(g.src[:keep], g.dst[:keep], g.shifts[:keep],
                    csr_row_ptr(g.dst[:keep], x.shape[0]), g.cell,
                    cutoff=g.cutoff)  # fmt: skip
        got = _run(G.geometry, x, sub, 2, 2)
        want = _run(G.geometry_torch, x, sub, 2, 2)
        for name, a, b in zip(NAMES, got, want, strict=True):
            assert a.shape == b.shape, (keep, name)
            assert rel_err(a, b) < 1e-12, (keep, name)
        assert got[0].shape == (keep, 9, 2, 3)


def test_strided_positions_and_atoms_without_edges():
    """Positions as a strided view; atoms past every edge (an isolated atom far
    away) get a zero gradient."""
    x, g = _system()
    far = torch.tensor([[30.0, 30.0, 30.0]], dtype=x.dtype, device=DEV)
    wide = torch.cat([x, far]).repeat_interleave(2, dim=1)  # (N + 1, 6)
    xs = wide[:, ::2]
    assert not xs.is_contiguous()
    g2 = Graph(g.src, g.dst, g.shifts, torch.cat([g.row_ptr, g.row_ptr[-1:]]),
               g.cell, cutoff=g.cutoff)  # fmt: skip
    got = _run(G.geometry, xs, g2, 2, 1)
    want = _run(G.geometry_torch, xs.contiguous(), g2, 2, 1)
    for name, a, b in zip(NAMES, got, want, strict=True):
        assert rel_err(a, b) < 1e-12, name
    assert torch.equal(got[4][-1], torch.zeros(3, dtype=x.dtype, device=DEV))


def test_float32_three_way():
    """float32 kernels against float64, within twice the float32 reference's error
    (plus the float32 tolerance)."""
    x, g = _system(dtype=torch.float64)
    truth = _run(G.geometry_torch, x, g, 2, 2)
    x32 = x.float()
    g32 = _with_cell(g, g.cell.float())
    got = _run(G.geometry, x32, g32, 2, 2)
    ref = _run(G.geometry_torch, x32, g32, 2, 2)
    for name, a, b, t in zip(NAMES, got, ref, truth, strict=True):
        assert a.dtype == torch.float32
        assert_close_three_way(a, b, t, name)


def test_the_gradient_is_deterministic():
    x, g = _system()
    a = _run(G.geometry, x, g, 2, 2)
    b = _run(G.geometry, x, g, 2, 2)
    for name, u, v in zip(NAMES, a, b, strict=True):
        assert torch.equal(u, v), name


def test_second_derivative_by_the_reference():
    """Force training differentiates the gradient: the backward is differentiable
    PyTorch there (gradgradcheck in float64 on a small graph)."""
    x, g = _system(cutoff=2.2)
    assert 0 < g.n_edges < 200
    x = x.detach().requires_grad_()
    cell = g.cell.detach().requires_grad_()

    def fn(x, cell):
        return G.geometry(x, _with_cell(g, cell), 2, 1, PAD)

    torch.autograd.gradgradcheck(fn, (x, cell), fast_mode=True)


@pytest.mark.parametrize("L,M", [(1, 0), (2, 1), (2, 2), (3, 2)])
def test_pack_is_the_edge_frame_layout(L, M):
    """The reference composition packs D as the edge-frame kernels read it."""
    from ecekern import edge_frame, so3

    D = so3.edge_frames(L, torch.randn(6, 3, dtype=torch.float64))
    assert torch.equal(G.pack(D, M), edge_frame.pack(D, M))


def test_src_order_is_a_stable_sort_by_source():
    x, g = _system()
    ptr, perm = G.src_order(g)
    src = g.src[perm]
    assert torch.all(src[1:] >= src[:-1])
    for n in range(x.shape[0]):
        seg = perm[ptr[n] : ptr[n + 1]]
        assert torch.all(g.src[seg] == n) and torch.all(seg[1:] > seg[:-1])
    assert int(ptr[-1]) == g.n_edges


def test_library_ops_pass_opcheck():
    x, g = _system(cutoff=2.2)
    cell = g.cell.contiguous()
    args = (x, cell, g.src, g.dst, g.shifts, PAD, g.cutoff, 2, 2, False)
    torch.library.opcheck(torch.ops.ecekern.geometry_fwd.default, args)
    E = g.n_edges
    grads = (torch.randn(E, 9, 2, 3, dtype=x.dtype, device=DEV),
             torch.randn(E, 8, dtype=x.dtype, device=DEV),
             torch.randn(E, dtype=x.dtype, device=DEV),
             torch.randn(E, dtype=x.dtype, device=DEV))  # fmt: skip
    torch.library.opcheck(torch.ops.ecekern.geometry_bwd.default, (*grads, *args))
    ptr, perm = G.src_order(g)
    gr = torch.randn(E, 3, dtype=x.dtype, device=DEV)
    torch.library.opcheck(torch.ops.ecekern.geometry_atoms.default,
                          (gr, g.row_ptr, ptr, perm))  # fmt: skip


def test_bad_inputs_are_clear_errors():
    x, g = _system(cutoff=2.2)
    with pytest.raises(TypeError, match="ecekern.Graph"):
        G.geometry(x, (g.src, g.dst), 2, 2, PAD)
    with pytest.raises(ValueError, match=r"\(N, 3\)"):
        G.geometry(x[:, :2], g, 2, 2, PAD)
    with pytest.raises(ValueError, match="generated tiles"):
        G.geometry(x, g, 3, 2, PAD)
    with pytest.raises(ValueError, match="float32 and float64"):
        G.geometry(x.half(), g, 2, 2, PAD)
    with pytest.raises(ValueError, match="float32 and float64"):
        G.geometry(x.long(), g, 2, 2, PAD)
    assert G.why_not(DEV, 2, 2, torch.float32) is None
    assert "mps" in (G.why_not("mps", 2, 2, torch.float32) or "")


def test_the_generated_tiles_are_the_generators_output():
    """``python -m ecekern.tools.gen_geometry`` writes the three tile files: the
    stored ones are its output, unedited."""
    pytest.importorskip("sympy")
    from ecekern.tools import gen_geometry

    for name in gen_geometry.FILES:
        text = gen_geometry.formatted(gen_geometry.render(name))
        assert text == (gen_geometry.STEP / name).read_text(), name


@pytest.mark.gpu
@pytest.mark.parametrize("L,M", VARIANTS)
def test_gpu_float32_three_way_on_a_larger_cell(L, M):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    x, g = _system(repeats=3, cutoff=5.0)
    gp = _padded(x, g, per_atom=3)
    truth = _run(G.geometry_torch, x, gp, L, M)
    x32, g32 = x.float(), _with_cell(gp, gp.cell.float())
    got = _run(G.geometry, x32, g32, L, M)
    ref = _run(G.geometry_torch, x32, g32, L, M)
    for name, a, b, t in zip(NAMES, got, ref, truth, strict=True):
        assert_close_three_way(a, b, t, f"({L}, {M}) {name}")
