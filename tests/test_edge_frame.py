"""Chapter 3's edge-frame kernels against the reference (in Triton's interpreter on a
CPU, on the GPU elsewhere), both ways of reading D."""

import pytest
import torch

import ecekern
from ecekern import edge_frame, options, plan, reference, so3
from ecekern._triton import INTERPRET
from ecekern.graph import csr_row_ptr
from ecekern.testing import assert_close_three_way, rel_err

DEV = "cpu" if INTERPRET else "cuda"
VARIANTS = ("packed", "table")


def _graph(E, N, seed=0, empty_nodes=()):
    g = torch.Generator().manual_seed(seed)
    nodes = torch.tensor([n for n in range(N) if n not in empty_nodes])
    dst = torch.sort(nodes[torch.randint(0, len(nodes), (E,), generator=g)]).values
    src = nodes[torch.randint(0, len(nodes), (E,), generator=g)]
    return src.to(DEV), dst.to(DEV), csr_row_ptr(dst, N).to(DEV)


def _inputs(E, N, L, M, C, Cp, dtype=torch.float64, seed=0, empty_nodes=()):
    """h, D (a Wigner matrix of random directions: block-diagonal), rho, y_cos,
    y_sin, w and the graph."""
    g = torch.Generator().manual_seed(seed + 1)
    src, dst, row_ptr = _graph(E, N, seed, empty_nodes)
    S = (L + 1) ** 2

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(DEV, dtype)

    D = so3.edge_frames(L, rnd(E, 3).double()).to(dtype)
    h, rho = rnd(N, S, C), rnd(E, 2 * C * (L + 1))
    yc, ys = rnd(E, Cp * (L + 1), M + 1), rnd(E, Cp * (L + 1), M + 1)
    w = torch.rand(E, generator=g, dtype=torch.float64).to(DEV, dtype)
    leaves = [t.requires_grad_() for t in (h, D, rho, yc, ys, w)]
    return leaves, (src, dst, row_ptr)


def _block_mask(L):
    l_of_s = so3.lm_tables(L).l_of_s.to(DEV)
    return l_of_s[:, None] == l_of_s[None, :]


def _rotate(fn, leaves, graph, M, seed=2):
    h, D, rho = leaves[:3]
    src, dst, _ = graph
    x = fn(h, src, dst, D, M, rho)
    g = torch.Generator().manual_seed(seed)
    G = [torch.randn(t.shape, generator=g, dtype=torch.float64).to(t) for t in x]
    return (*x, *torch.autograd.grad(x, (h, D, rho), G))


def _ref_rotate(h, src, dst, D, M, rho):
    x_cos, x_sin = reference.rotate_and_select(h, src, dst, D, M)
    return x_cos * rho[:, :, None], x_sin * rho[:, :, None]


def _unrotate(fn, leaves, graph, M, seed=3):
    _, D, _, yc, ys, w = leaves
    _, dst, row_ptr = graph
    out = fn(yc, ys, D, M, dst, row_ptr, 0.37, w)
    g = torch.Generator().manual_seed(seed)
    G = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out)
    return (out, *torch.autograd.grad(out, (yc, ys, D, w), G))


def _ref_unrotate(yc, ys, D, M, dst, row_ptr, scale, w):
    msg = reference.pack_and_unrotate(yc, ys, D, M)
    return reference.aggregate(msg, dst, row_ptr.shape[0] - 1, scale, w)


def _compare(got, ref, L, d_index, tol=1e-12):
    """Every output and gradient to ``tol``; D's gradient on its blocks (the entries
    off the blocks are structural zeros: not read, no gradient)."""
    mask = _block_mask(L)
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert a.shape == b.shape, i
        if i == d_index:
            assert a[..., ~mask].abs().max() == 0 if a.numel() else True
            a, b = a * mask, b * mask
        assert rel_err(a, b) < tol, (i, rel_err(a, b))


CASES = [
    (37, 6, 2, 2, 3, 4),
    (29, 5, 1, 1, 5, 2),
    (31, 4, 3, 1, 4, 3),
    (19, 4, 4, 4, 2, 3),
    (23, 5, 3, 3, 17, 1),
    (1, 1, 2, 2, 2, 2),
    (21, 4, 2, 0, 3, 2),
]
IDS = ["L2", "L1", "L3-M1", "L4", "C17", "one-edge", "M0"]


#: the table layout's largest cases run with `make slow` and on the GPU (the packed
#: layout, the library's, keeps every case in the CPU suite)
SLOW_TABLE = ("L3-M1", "L4", "C17")


@pytest.mark.parametrize(
    "variant, E, N, L, M, C, Cp",
    [pytest.param(v, *case, id=f"{i}-{v}",
                  marks=[pytest.mark.slow] if v == "table" and i in SLOW_TABLE else [])
     for case, i in zip(CASES, IDS) for v in VARIANTS],
)  # fmt: skip
def test_fp64_matches_reference(variant, E, N, L, M, C, Cp):
    leaves, graph = _inputs(E, N, L, M, C, Cp)

    def fused(*a):
        return edge_frame.rotate_and_select(*a, variant=variant)

    _compare(_rotate(fused, leaves, graph, M), _rotate(_ref_rotate, leaves, graph, M),
             L, 3)  # fmt: skip

    def fused_u(*a):
        return edge_frame.unrotate_and_aggregate(*a, variant=variant)

    _compare(
        _unrotate(fused_u, leaves, graph, M),
        _unrotate(_ref_unrotate, leaves, graph, M),
        L,
        3,
    )


@pytest.mark.parametrize("variant", VARIANTS)
def test_no_edges_and_nodes_without_edges(variant):
    leaves, graph = _inputs(0, 3, 2, 2, 3, 2)
    x = edge_frame.rotate_and_select(*leaves[:1], *graph[:2], leaves[1], 2,
                                     leaves[2], variant=variant)  # fmt: skip
    assert x[0].shape == (0, 18, 3)
    out = edge_frame.unrotate_and_aggregate(
        *leaves[3:5], leaves[1], 2, *graph[1:], 0.5, leaves[5], variant=variant
    )
    assert out.shape == (3, 9, 2) and out.abs().max() == 0
    leaves, graph = _inputs(30, 8, 2, 2, 3, 2, empty_nodes=(0, 3, 7))

    def fused_u(*a):
        return edge_frame.unrotate_and_aggregate(*a, variant=variant)

    got = _unrotate(fused_u, leaves, graph, 2)
    assert got[0][[0, 3, 7]].abs().max() == 0
    _compare(got, _unrotate(_ref_unrotate, leaves, graph, 2), 2, 3)
    _compare(
        _rotate(
            lambda *a: edge_frame.rotate_and_select(*a, variant=variant),
            leaves, graph, 2,
        ),
        _rotate(_ref_rotate, leaves, graph, 2),
        2,
        3,
    )  # fmt: skip


def test_without_rho_and_without_edge_weight():
    leaves, (src, dst, row_ptr) = _inputs(25, 5, 2, 1, 3, 2)
    h, D, _, yc, ys, _ = leaves
    got = edge_frame.rotate_and_select(h, src, dst, D, 1)
    for a, b in zip(got, reference.rotate_and_select(h, src, dst, D, 1)):
        assert rel_err(a, b) < 1e-12
    got = edge_frame.unrotate_and_aggregate(yc, ys, D, 1, dst, row_ptr, 0.2)
    assert rel_err(got, _ref_unrotate(yc, ys, D, 1, dst, row_ptr, 0.2, None)) < 1e-12
    msg = edge_frame.pack_and_unrotate(yc, ys, D, 1)
    assert rel_err(msg, reference.pack_and_unrotate(yc, ys, D, 1)) < 1e-12


def test_fp32_three_way():
    leaves64, graph = _inputs(41, 6, 3, 3, 6, 5)
    leaves32 = [t.detach().float().requires_grad_() for t in leaves64]
    truth = _rotate(_ref_rotate, leaves64, graph, 3)
    mask = _block_mask(3)
    for got, ref32, t in zip(
        _rotate(edge_frame.rotate_and_select, leaves32, graph, 3),
        _rotate(_ref_rotate, leaves32, graph, 3),
        truth,
    ):
        if got.shape[-2:] == mask.shape and got.shape[0] == 41:  # dD: its blocks
            got, ref32, t = got * mask, ref32 * mask, t * mask
        assert_close_three_way(got, ref32, t, "rotate")
    truth = _unrotate(_ref_unrotate, leaves64, graph, 3)
    for got, ref32, t in zip(
        _unrotate(edge_frame.unrotate_and_aggregate, leaves32, graph, 3),
        _unrotate(_ref_unrotate, leaves32, graph, 3),
        truth,
    ):
        if got.shape[-2:] == mask.shape and got.shape[0] == 41:
            got, ref32, t = got * mask, ref32 * mask, t * mask
        assert_close_three_way(got, ref32, t, "unrotate")


@pytest.mark.parametrize("variant", VARIANTS)
def test_strided_inputs(variant):
    """Slices and transposes for every tensor argument, index tensors included."""
    leaves, (src, dst, row_ptr) = _inputs(27, 5, 2, 2, 3, 2)
    h, D, rho, yc, ys, w = leaves
    h_t = h.detach().transpose(0, 2).contiguous().transpose(0, 2)
    rho_s = torch.cat([rho.detach(), rho.detach()], 1)[:, ::2]
    src_s = torch.stack([src, src], 1)[:, 0]
    dst_s = torch.stack([dst, dst], 1)[:, 1]
    ptr_s = torch.stack([row_ptr, row_ptr], 1)[:, 0]
    w_s = torch.stack([w.detach(), w.detach()], 1)[:, 0]
    y_t = yc.detach().transpose(1, 2).contiguous().transpose(1, 2)
    assert not (h_t.is_contiguous() or rho_s.is_contiguous() or src_s.is_contiguous())
    got = edge_frame.rotate_and_select(h_t, src_s, dst_s, D, 2, rho_s, variant=variant)
    ref = _ref_rotate(h, src, dst, D, 2, rho_s)
    for a, b in zip(got, ref):
        assert rel_err(a, b) < 1e-12
    got = edge_frame.unrotate_and_aggregate(y_t, ys, D, 2, dst_s, ptr_s, 0.3, w_s,
                                            variant=variant)  # fmt: skip
    assert rel_err(got, _ref_unrotate(yc, ys, D, 2, dst, row_ptr, 0.3, w)) < 1e-12


@pytest.mark.parametrize("variant", VARIANTS)
def test_planes_layout(variant):
    """``planes=True``: the rows as the cos and sin views of one ``(n_ang, 2, E,
    F)`` tensor (chapter 6's layout), the same values bit for bit; the gradients of
    planes-laid-out output gradients, an unrotation of planes rows and its dy (in
    the planes layout), all equal to the contiguous rows'; a pair of two different
    layouts is read right too."""
    from ecekern._planes import as_planes, planes_pair

    def is_planes_pair(a, b):
        return as_planes(a, b) is not None

    def rows_pair(E, W, n_ang, like, planes):
        return planes_pair(like, E, W, n_ang)[1:]

    L, M = 2, 2
    leaves, (src, dst, row_ptr) = _inputs(33, 6, L, M, 3, 2)
    h, D, rho, yc, ys, w = leaves
    frames = edge_frame.Frames(D, M, src, dst, 6, row_ptr, variant=variant)
    rows = frames.rotate_and_select(h, rho)
    planes = frames.rotate_and_select(h, rho, planes=True)
    assert not is_planes_pair(*rows) and is_planes_pair(*planes)
    for a, b in zip(planes, rows, strict=True):
        assert torch.equal(a, b)
    g = [torch.randn_like(t) for t in rows]
    gp = rows_pair(*g[0].shape, g[0], True)
    for a, b in zip(gp, g, strict=True):
        a.copy_(b)
    want = torch.autograd.grad(rows, (h, D, rho), g, retain_graph=True)
    got = torch.autograd.grad(planes, (h, D, rho), gp, retain_graph=True)
    for a, b in zip(got, want, strict=True):
        assert rel_err(a, b) < 1e-14
    yp = rows_pair(*yc.shape, yc, True)
    for a, b in zip(yp, (yc, ys), strict=True):
        a.copy_(b.detach())
    yp = [t.requires_grad_() for t in yp]
    out = frames.unrotate_and_aggregate(yc, ys, 0.37, w)
    outp = frames.unrotate_and_aggregate(*yp, 0.37, w)
    mixed = frames.unrotate_and_aggregate(yp[0], ys, 0.37, w)
    assert rel_err(outp, out) < 1e-14 and rel_err(mixed, out) < 1e-14
    G = torch.randn_like(out)
    want = torch.autograd.grad(out, (yc, ys, D, w), G, retain_graph=True)
    got = torch.autograd.grad(outp, (*yp, D, w), G, retain_graph=True)
    assert is_planes_pair(got[0], got[1])
    for a, b in zip(got, want, strict=True):
        assert rel_err(a, b) < 1e-14
    wide = torch.zeros((M + 1, 3, *yc.shape[:2]), dtype=yc.dtype, device=yc.device)
    gapped = [wide[:, k].permute(1, 2, 0) for k in (0, 2)]  # planes with a gap
    for a, b in zip(gapped, (yc, ys), strict=True):
        a.copy_(b.detach())
    gapped = [t.requires_grad_() for t in gapped]
    outg = frames.unrotate_and_aggregate(*gapped, 0.37, w)
    got = torch.autograd.grad(outg, (*gapped, D, w), G)
    assert rel_err(outg, out) < 1e-14
    for a, b in zip(got, want, strict=True):
        assert rel_err(a, b) < 1e-14
    with pytest.raises(TypeError, match="planes"):
        frames.rotate_and_select(h, rho, planes=1)


def test_deterministic():
    leaves, graph = _inputs(60, 5, 2, 2, 4, 3)
    a = _rotate(edge_frame.rotate_and_select, leaves, graph, 2)
    b = _rotate(edge_frame.rotate_and_select, leaves, graph, 2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    a = _unrotate(edge_frame.unrotate_and_aggregate, leaves, graph, 2)
    b = _unrotate(edge_frame.unrotate_and_aggregate, leaves, graph, 2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_gradcheck_and_gradgradcheck_through_positions(variant):
    """D from edge vectors, so dD reaches them as the forces need (first derivative
    by the kernels); the second derivative (a force-training step) through the
    differentiable PyTorch form. Small: the interpreter runs every evaluation."""
    src, dst, row_ptr = _graph(5, 3, seed=4)
    g = torch.Generator().manual_seed(5)
    r = torch.randn(5, 3, generator=g, dtype=torch.float64).to(DEV).requires_grad_()
    h = torch.randn(3, 4, 2, generator=g, dtype=torch.float64).to(DEV)
    rho = torch.randn(5, 2 * 2 * 2, generator=g, dtype=torch.float64).to(DEV)
    w = torch.rand(5, generator=g, dtype=torch.float64).to(DEV).requires_grad_()

    def f(r, w):
        D = so3.edge_frames(1, r)
        fr = edge_frame.Frames(D, 1, src, dst, 3, row_ptr, variant)
        x_cos, x_sin = fr.rotate_and_select(h, rho)
        y_cos, y_sin = x_cos[:, ::2] * 0.5, x_sin[:, 1::2]  # C' = 2 of 2C = 4
        return fr.unrotate_and_aggregate(y_cos, y_sin, 0.7, w)

    assert torch.autograd.gradcheck(f, (r, w))
    if variant == "packed":  # the second derivative is the same PyTorch for both
        assert torch.autograd.gradgradcheck(lambda r: f(r, w).sum(1), (r,))


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_differentiable_backward_through_both_ops_gives_the_same_gradient(variant):
    """Under create_graph (force training) the backwards are PyTorch: rotate and
    unrotate share the frame tiles, and the unrotation's y comes from the rotation,
    so each backward must give its partial derivative only (a total one counts the
    path through the rotation twice: 40 % off before this was caught)."""
    leaves, (src, dst, row_ptr) = _inputs(24, 5, 2, 2, 3, 3, seed=7)
    h, D, rho, _, _, w = leaves

    def grads(create_graph):
        fr = edge_frame.Frames(D, 2, src, dst, 5, row_ptr, variant)
        xc, xs = fr.rotate_and_select(h, rho)
        out = fr.unrotate_and_aggregate(xc[:, ::2] * 0.5, xs[:, 1::2], 0.7, w)
        G = torch.randn(out.shape, generator=torch.Generator().manual_seed(1),
                        dtype=torch.float64).to(out)  # fmt: skip
        return torch.autograd.grad(out, (h, D, rho, w), G, create_graph=create_graph)

    for a, b in zip(grads(False), grads(True), strict=True):
        assert rel_err(b, a) < 1e-13


def test_gradients_of_h_rho_and_w_by_gradcheck():
    src, dst, row_ptr = _graph(4, 2, seed=6)
    g = torch.Generator().manual_seed(7)
    D = so3.edge_frames(1, torch.randn(4, 3, generator=g, dtype=torch.float64))
    args = [
        torch.randn(2, 4, 1, generator=g, dtype=torch.float64),
        torch.randn(4, 4, generator=g, dtype=torch.float64),
        torch.rand(4, generator=g, dtype=torch.float64),
    ]
    h, rho, w = (t.to(DEV).requires_grad_() for t in args)
    fr = edge_frame.Frames(D.to(DEV), 1, src, dst, 2, row_ptr, "packed")

    def f(h, rho, w):
        x_cos, x_sin = fr.rotate_and_select(h, rho)
        return fr.unrotate_and_aggregate(x_cos[:, :2], x_sin[:, 2:], 0.7, w)

    assert torch.autograd.gradcheck(f, (h, rho, w))


@pytest.mark.parametrize(
    "change, err",
    [
        (lambda a: a.update(h=a["h"][:, :4]), ValueError),
        (lambda a: a.update(h=a["h"].float()), TypeError),
        (lambda a: a.update(rho=a["rho"][:, :5]), ValueError),
        (lambda a: a.update(src=a["src"].int()), TypeError),
        (lambda a: a.update(src=a["src"][:-1]), ValueError),
        (lambda a: a.update(src=a["src"] + 100), ValueError),
        (lambda a: a.update(mmax=3), ValueError),
        (lambda a: a.update(D=a["D"][:, :5, :5]), ValueError),
    ],
    ids=[
        "h-shape",
        "h-dtype",
        "rho-shape",
        "src-int32",
        "src-len",
        "src-range",
        "mmax",
        "D-not-square-of-L",
    ],  # fmt: skip
)
@pytest.mark.parametrize("variant", ["packed", "reference"])
def test_bad_inputs_rotate(change, err, variant):
    """The same errors whichever path serves the call."""
    leaves, (src, dst, _) = _inputs(12, 4, 2, 2, 3, 2)
    a = dict(h=leaves[0], src=src, dst=dst, D=leaves[1], mmax=2, rho=leaves[2])
    change(a)
    with pytest.raises(err):
        edge_frame.rotate_and_select(**a, variant=variant)


@pytest.mark.parametrize(
    "change, err",
    [
        (lambda a: a.update(y_cos=a["y_cos"][:, :5]), ValueError),
        (lambda a: a.update(y_sin=a["y_sin"].float()), TypeError),
        (lambda a: a.update(edge_weight=a["edge_weight"][:3]), ValueError),
        (lambda a: a.update(row_ptr=a["row_ptr"].flip(0)), ValueError),
        (lambda a: a.update(dst=a["dst"].flip(0)), ValueError),
    ],
    ids=["y-shape", "y-dtype", "w-shape", "row-ptr", "unsorted-dst"],
)
def test_bad_inputs_unrotate(change, err):
    leaves, (src, dst, row_ptr) = _inputs(12, 4, 2, 2, 3, 2)
    a = dict(y_cos=leaves[3], y_sin=leaves[4], D=leaves[1], mmax=2, dst=dst,
             row_ptr=row_ptr, scale=0.3, edge_weight=leaves[5])  # fmt: skip
    change(a)
    with pytest.raises(err):
        edge_frame.unrotate_and_aggregate(**a, variant="packed")


@pytest.mark.parametrize(
    "change",
    [
        lambda a: a.update(row_ptr=a["row_ptr"][:2]),
        lambda a: a.update(row_ptr=a["row_ptr"].double()),
        lambda a: a.update(dst=a["dst"].flip(0)),
        lambda a: a.update(src=a["src"] - 1),
        lambda a: a.update(n_nodes=5),
    ],
    ids=["row-ptr-short", "row-ptr-float", "dst-unsorted", "src-negative", "n-nodes"],
)
def test_frames_check_their_graph(change):
    leaves, (src, dst, row_ptr) = _inputs(12, 4, 2, 2, 3, 2)
    a = dict(D=leaves[1], mmax=2, src=src, dst=dst, n_nodes=4, row_ptr=row_ptr)
    change(a)
    with pytest.raises((ValueError, TypeError)):
        edge_frame.Frames(**a)


def test_unvalidated_indices_out_of_range_write_every_row():
    """Indices out of range, not validated: wrong rows, but every row written (no
    uninitialised memory) and no out-of-bounds access."""
    leaves, (src, dst, _) = _inputs(12, 4, 2, 2, 3, 2)
    bad = src.clone()
    bad[3] = 7
    for _ in range(2):  # fresh allocations reuse freed memory: garbage would show
        x = edge_frame.rotate_and_select(
            leaves[0], bad, dst, leaves[1], 2, variant="packed", validate=False
        )
        assert all(bool(torch.isfinite(t).all()) for t in x)
        good = edge_frame.rotate_and_select(
            leaves[0], src, dst, leaves[1], 2, variant="packed"
        )
        keep = torch.arange(12, device=DEV) != 3
        assert torch.equal(x[0][keep], good[0][keep])


def test_unvalidated_bad_csr_never_reads_out_of_bounds():
    leaves, (src, dst, row_ptr) = _inputs(12, 4, 2, 2, 3, 2)
    bad = torch.tensor([0, 50, -3, 7, 2], device=DEV)
    out = edge_frame.unrotate_and_aggregate(*leaves[3:5], leaves[1], 2, dst, bad, 0.3,
                                            validate=False)  # fmt: skip
    assert out.shape == (4, 9, 2) and bool(torch.isfinite(out).all())


def test_degree_outside_the_kernels_falls_back_loudly():
    leaves, (src, dst, _) = _inputs(6, 3, 2, 2, 2, 2)
    h = torch.randn(3, 36, 2, dtype=torch.float64, device=DEV)
    D = so3.edge_frames(5, torch.randn(6, 3, dtype=torch.float64, device=DEV))
    options.reset_fallback_warnings()
    with pytest.warns(options.FallbackWarning, match="L = 5"):
        got = edge_frame.rotate_and_select(h, src, dst, D, 5, variant="packed")
    ref = reference.rotate_and_select(h, src, dst, D, 5)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_half_precision_falls_back_loudly():
    leaves, (src, dst, _) = _inputs(6, 3, 1, 1, 2, 2)
    h, D = leaves[0].detach().bfloat16(), leaves[1].detach().bfloat16()
    options.reset_fallback_warnings()
    with pytest.warns(options.FallbackWarning, match="bfloat16"):
        got = edge_frame.rotate_and_select(h, src, dst, D, 1, variant="packed")
    ref = reference.rotate_and_select(h, src, dst, D, 1)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_the_plan_takes_the_option_and_the_reference_switch():
    """The edge-frame stage is the plan's: the option where it can serve, the
    reference under ``reference=True`` (on CUDA too), packed by default on CUDA."""
    shapes = plan.Shapes(2, 2, 4, 1)

    def stage(device, **opts):
        cap = (9, 0) if device == "cuda" else None
        got = plan.resolve(device, cap, torch.float32, False, shapes,
                           options.Options(**opts))  # fmt: skip
        return got.edge_frame

    if INTERPRET:  # CPU tensors run the kernels only in the interpreter
        assert stage("cpu", edge_frame="table") == "table"
    assert stage("cuda", edge_frame="table", reference=True) == "reference"
    assert stage("cpu") == "reference" and stage("cuda") == "packed"
    with pytest.raises(ValueError, match="edge_frame"):
        options.Options(edge_frame="fast")
    with pytest.raises(ValueError, match="variant"):
        edge_frame.frames_for(torch.zeros(1, 9, 9), 2, *[torch.zeros(1, dtype=int)] * 2,
                              1, None, "fast")  # fmt: skip


def test_pack_holds_the_selected_blocks():
    D = so3.edge_frames(2, torch.randn(5, 3, dtype=torch.float64))
    P = edge_frame.pack(D, 1)
    assert P.shape == (5, 9, 2, 2)
    t = so3.lm_tables(2, 1)
    for s in range(9):
        l = int(t.l_of_s[s])
        for m in range(2):
            cos_row, sin_row = int(t.cos_index[l, m]), int(t.sin_index[l, m])
            want_c = D[:, cos_row, s] if cos_row < 9 else torch.zeros(5).double()
            want_s = D[:, sin_row, s] if sin_row < 9 else torch.zeros(5).double()
            assert torch.equal(P[:, s, 0, m], want_c)
            assert torch.equal(P[:, s, 1, m], want_s)


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_model_energy_and_forces_match_the_reference(variant):
    cfg = ecekern.ECEConfig(
        channels=4, radial_hidden=8, readout_hidden=8, n_gated=1, cutoff=2.6
    )
    model = ecekern.ECEModel(cfg).double().to(DEV)
    atoms = ecekern.systems.diamond(1)
    with options.use(reference=True):
        e_ref, f_ref = ecekern.energy_and_forces(model, atoms)
    with options.use(edge_frame=variant, linear="einsum", zonal="reference"):
        e, f = ecekern.energy_and_forces(model, atoms)
    assert abs(float(e - e_ref)) < 1e-12 * max(1.0, abs(float(e_ref)))
    assert rel_err(f, f_ref) < 1e-11


# --------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("L", [1, 2, 3, 4])
def test_gpu_larger_graphs_three_way(variant, L):
    leaves64, graph = _inputs(3000, 40, L, L, 32, 32, seed=L)
    leaves32 = [t.detach().float().requires_grad_() for t in leaves64]
    mask = _block_mask(L)

    def fused(*a):
        return edge_frame.rotate_and_select(*a, variant=variant)

    def fused_u(*a):
        return edge_frame.unrotate_and_aggregate(*a, variant=variant)

    for fn, ref in (
        (_rotate, (fused, _ref_rotate)),
        (_unrotate, (fused_u, _ref_unrotate)),
    ):
        truth = fn(ref[1], leaves64, graph, L)
        _compare(fn(ref[0], leaves64, graph, L), truth, L, 3)
        for got, r32, t in zip(fn(ref[0], leaves32, graph, L),
                               fn(ref[1], leaves32, graph, L), truth):  # fmt: skip
            if got.shape[-2:] == mask.shape and got.shape[0] == 3000:
                got, r32, t = got * mask, r32 * mask, t * mask
            assert_close_three_way(got, r32, t, f"{variant} L={L}")


@pytest.mark.gpu
def test_gpu_compiled_model_with_the_edge_frame_kernels_equals_eager():
    cfg = ecekern.ECEConfig()
    model = ecekern.ECEModel(cfg).to("cuda")
    pos, numbers, graph = ecekern.model.prepare_inputs(
        ecekern.systems.diamond(2), cfg.cutoff, torch.float32, "cuda"
    )
    with options.use(edge_frame="packed", linear="einsum", zonal="reference"):
        e, f = ecekern.model.force_step(model, pos, numbers, graph)
        torch._dynamo.reset()
        ec, fc = ecekern.model.force_step(torch.compile(model), pos, numbers, graph)
    torch._dynamo.reset()
    # fp32: inductor reorders the sums around the kernels (measured 3.7e-5 on forces)
    assert rel_err(ec, e) < 1e-5 and rel_err(fc, f) < 2e-4


# --------------------------------------------------------------------------------------
# torch.library ops and torch.compile
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "row_ptr_given",
    [True, pytest.param(False, marks=pytest.mark.slow)],  # perm: `make slow`, GPU
    ids=["csr", "perm"],
)
def test_library_ops_pass_opcheck(row_ptr_given):
    """The four ops: schema, fake implementation (shapes and strides of the outputs,
    the planes layout included) and AOT dispatch, against the kernels (custom ops in
    the interpreter; the same fakes serve the triton_ops on a GPU)."""
    from ecekern.edge_frame import autograd as efa
    from ecekern.edge_frame.launch import rows_views

    L, M = 2, 1
    leaves, (src, dst, row_ptr) = _inputs(9, 4, L, M, 2, 3)
    h, D, rho, yc, ys, w = (t.detach() for t in leaves)
    fr = edge_frame.Frames(D, M, src, dst, 4, row_ptr if row_ptr_given else None)
    la, meta = fr.launch, (L, M, fr.packed)
    assert (fr.csr[1] is None) == row_ptr_given
    for planes, r in ((False, rho), (True, rho), (False, None)):
        args = (h, fr.d, fr.tab, r, *fr.csr, *meta, planes)
        launch = (la.rotate_block, la.rotate_warps)
        torch.library.opcheck(efa._rotate_op, (*args, *launch))
        X = efa._rotate_op(*args, *launch)
        gc, gs = (torch.randn_like(t) for t in rows_views(X, planes))
        bwd = (gc, gs, h, fr.d, fr.tab, r, *fr.csr, *meta)
        launch = (la.rotate_bwd_block, la.rotate_bwd_warps)
        torch.library.opcheck(efa._rotate_bwd_op, (*bwd, *launch))
    if not row_ptr_given:
        return
    Y = torch.stack([yc, ys], 1).permute(3, 1, 0, 2).contiguous()  # planes (NA,2,E,F)
    pair = (Y[:, 0].permute(1, 2, 0), Y[:, 1].permute(1, 2, 0))
    G = torch.randn(4, (L + 1) ** 2, 3, dtype=h.dtype, device=h.device)
    for y, ww, need in (((yc, ys), w, (True, True)), (pair, None, (False, True))):
        args = (*y, fr.d, fr.tab, ww, row_ptr, 0.37, *meta)
        torch.library.opcheck(
            efa._unrotate_op, (*args, la.unrotate_block, la.unrotate_warps)
        )
        launch = (la.unrotate_bwd_block, la.unrotate_bwd_warps)
        torch.library.opcheck(
            efa._unrotate_bwd_op, (G, *args[:7], *meta, *need, *launch)
        )


def _compiled_vs_eager(backend, dtype, tol, L=2, M=2):
    """A small function of the ops (rotation in both layouts, unrotation with its
    aggregation) compiled with ``backend``, fullgraph, against eager: values and the
    first derivatives of every input (D's through the :class:`Frames` built outside,
    in eager mode, as the model's step builds them once)."""
    leaves, (src, dst, row_ptr) = _inputs(41, 7, L, M, 3, 2, dtype=dtype)
    h, D, rho, yc, ys, w = leaves

    def f(fr, h, rho, yc, ys, w):
        x = fr.rotate_and_select(h, rho)
        xp = fr.rotate_and_select(h, rho, planes=True)
        out = fr.unrotate_and_aggregate(yc, ys, 0.37, w)
        return (*x, *xp, out)

    def run(fn):
        fr = edge_frame.Frames(D, M, src, dst, 7, row_ptr)
        outs = fn(fr, h, rho, yc, ys, w)
        g = torch.Generator().manual_seed(4)
        gs = [torch.randn(t.shape, generator=g).to(t) for t in outs]
        return (*outs, *torch.autograd.grad(outs, leaves, gs))

    torch._dynamo.reset()
    try:
        got = run(torch.compile(f, backend=backend, fullgraph=True))
    finally:
        torch._dynamo.reset()
    want = run(f)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.shape == b.shape and rel_err(a, b) < tol, (i, rel_err(a, b))


def test_compiled_matches_eager_through_the_ops():
    """Traced by Dynamo and AOT autograd (``aot_eager``: the ops are the graph's
    leaves, run by the interpreter here), fullgraph: the same numbers."""
    _compiled_vs_eager("aot_eager", torch.float64, 1e-13)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)], ids=["fp64", "fp32"]
)
def test_gpu_inductor_compile_matches_eager(dtype, tol):
    """``torch.compile`` with inductor (the ops are triton_ops there: inductor traces
    the launches), fullgraph: values and first derivatives as in eager."""
    _compiled_vs_eager("inductor", dtype, tol)
