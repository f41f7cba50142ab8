import math

import pytest
import torch

from ecekern import reference, so3
from ecekern.graph import csr_row_ptr

G = lambda s: torch.Generator().manual_seed(s)

pytestmark = pytest.mark.usefixtures("float64_default")


def _rot_z(x_cos, x_sin, angle):
    """Turn each (cos, sin) pair of order m by m * angle (a rotation about the edge)."""
    m = torch.arange(x_cos.shape[-1], dtype=x_cos.dtype)
    c, s = torch.cos(m * angle), torch.sin(m * angle)
    return c * x_cos - s * x_sin, s * x_cos + c * x_sin


def test_equivariant_linear_commutes_with_edge_rotations():
    g = G(0)
    x_cos, x_sin = torch.randn(2, 7, 5, 3, generator=g)
    x_sin[..., 0] = 0
    w, b = torch.randn(3, 4, 5, generator=g), torch.randn(4, generator=g)
    y = reference.equivariant_linear(*_rot_z(x_cos, x_sin, 0.7), w, b)
    y_ref = _rot_z(*reference.equivariant_linear(x_cos, x_sin, w, b), 0.7)
    for a, r in zip(y, y_ref):
        torch.testing.assert_close(a, r, atol=1e-13, rtol=0)


def test_equivariant_linear_matches_explicit_loop():
    g = G(1)
    x_cos, x_sin = torch.randn(2, 6, 5, 3, generator=g)
    w, b = torch.randn(3, 4, 5, generator=g), torch.randn(4, generator=g)
    y_cos, y_sin = reference.equivariant_linear(x_cos, x_sin, w, b)
    for m in range(3):
        exp = x_cos[..., m] @ w[m].T + (b if m == 0 else 0)
        torch.testing.assert_close(y_cos[..., m], exp)
        torch.testing.assert_close(y_sin[..., m], x_sin[..., m] @ w[m].T)


def test_gate_commutes_with_edge_rotations():
    g = G(2)
    z_cos, z_sin = torch.randn(2, 9, 3, generator=g)
    z_sin[..., 0] = 0
    lhs = reference.gate(*_rot_z(z_cos, z_sin, -1.1))
    rhs = _rot_z(*reference.gate(z_cos, z_sin), -1.1)
    for a, r in zip(lhs, rhs):
        torch.testing.assert_close(a, r, atol=1e-13, rtol=0)


@pytest.mark.parametrize("L, M", [(1, 1), (2, 2), (2, 1), (3, 2), (4, 4)])
def test_select_then_pack_is_identity_on_kept_orders(L, M):
    g = G(L * 10 + M)
    E, C = 5, 3
    S = (L + 1) ** 2
    h = torch.randn(4, S, C, generator=g)
    src = torch.tensor([0, 1, 2, 3, 1])
    dst = torch.tensor([1, 1, 2, 3, 3])
    v = torch.randn(E, 3, generator=g)
    D = so3.edge_frames(L, v)
    x_cos, x_sin = reference.rotate_and_select(h, src, dst, D, M)
    F = 2 * C * (L + 1)
    assert x_cos.shape == x_sin.shape == (E, F, M + 1)
    msg = reference.pack_and_unrotate(x_cos, x_sin, D, M)  # (E, S, 2C)
    keep = (so3.lm_tables(L).m_of_s.abs() <= M).to(h.dtype)
    A = torch.cat([h[dst], h[src]], -1)
    expected = D.transpose(1, 2) @ (keep[None, :, None] * (D @ A))
    torch.testing.assert_close(msg, expected, atol=1e-13, rtol=0)
    # slots that do not exist stay zero
    t = so3.lm_tables(L, M)
    dead = (t.cos_index == S).repeat(2 * C, 1)
    assert x_cos[:, dead].abs().max() == 0
    assert x_sin[..., 0].abs().max() == 0


def test_zonal_rows_are_spherical_harmonics():
    v = torch.randn(6, 3, generator=G(3))
    L = 3
    Z = reference.zonal_rows(so3.edge_frames(L, v))
    Y = so3.spherical_harmonics(L, v)[:, 1:]
    l_of_s = so3.lm_tables(L).l_of_s[1:].double()
    torch.testing.assert_close(Z, Y * torch.sqrt(4 * math.pi / (2 * l_of_s + 1)))


def _zonal_loop(Z, R, dst, n, scale):
    E, L, C = R.shape
    out = torch.zeros(n, (L + 1) ** 2, C)
    l_of_s = so3.lm_tables(L).l_of_s
    for e in range(E):
        for s in range(1, (L + 1) ** 2):
            out[dst[e], s] += scale * Z[e, s - 1] * R[e, l_of_s[s] - 1]
    return out


@pytest.mark.parametrize(
    "E, N, L, C", [(0, 3, 2, 4), (1, 1, 1, 1), (9, 5, 3, 17), (12, 7, 4, 3)]
)
def test_zonal_scatter_matches_loop(E, N, L, C):
    g = G(E + N)
    dst = torch.sort(torch.randint(0, N, (E,), generator=g)).values
    Z = torch.randn(E, (L + 1) ** 2 - 1, generator=g)
    R = torch.randn(E, L, C, generator=g)
    out = reference.zonal_scatter(Z, R, dst, csr_row_ptr(dst, N), 0.3)
    assert out.shape == (N, (L + 1) ** 2, C)
    torch.testing.assert_close(out, _zonal_loop(Z, R, dst, N, 0.3))
    assert out[:, 0].abs().max() == 0


def test_zonal_scatter_gradgradcheck():
    g = G(7)
    dst = torch.tensor([0, 0, 2, 2, 2])
    Z = torch.randn(5, 8, generator=g, requires_grad=True)
    R = torch.randn(5, 2, 3, generator=g, requires_grad=True)
    f = lambda z, r: reference.zonal_scatter(z, r, dst, csr_row_ptr(dst, 4), 0.5)
    assert torch.autograd.gradcheck(f, (Z, R))
    assert torch.autograd.gradgradcheck(f, (Z, R))


def _zonal_args():
    Z, R = torch.randn(4, 8), torch.randn(4, 2, 3)
    dst = torch.tensor([0, 1, 1, 2])
    return Z, R, dst, csr_row_ptr(dst, 3), 1.0


@pytest.mark.parametrize(
    "change, err, match",
    [
        (lambda a: (a[0][:, :7],) + a[1:], ValueError, "Z must have shape"),
        (lambda a: (a[0].float(),) + a[1:], TypeError, "dtype"),
        (lambda a: (a[0], a[1][0]) + a[2:], ValueError, "R must have shape"),
        (lambda a: a[:2] + (a[2].int(),) + a[3:], TypeError, "int64"),
        (
            lambda a: a[:2] + (torch.tensor([0, 2, 1, 2]),) + a[3:],
            ValueError,
            "CSR|sorted",
        ),
        (lambda a: a[:2] + (torch.tensor([0, 1, 1, 3]),) + a[3:], ValueError, "CSR"),
        (lambda a: a[:3] + (torch.tensor([0, 1, 3, 3]),) + a[4:], ValueError, "CSR"),
        (lambda a: a[:3] + (torch.tensor([0, 2, 3, 4, 4]),) + a[4:], ValueError, "CSR"),
        (lambda a: a[:2] + (torch.tensor([0, 1, 1]),) + a[3:], ValueError, "entries"),
    ],
)
def test_zonal_scatter_bad_inputs(change, err, match):
    with pytest.raises(err, match=match):
        reference.zonal_scatter(*change(_zonal_args()))


def test_equivariant_linear_bad_inputs():
    x = torch.randn(4, 5, 3)
    w = torch.randn(3, 2, 5)
    with pytest.raises(ValueError):
        reference.equivariant_linear(x, x, torch.randn(2, 2, 5), None)
    with pytest.raises(ValueError):
        reference.equivariant_linear(x, x, torch.randn(3, 2, 4), None)
    with pytest.raises(ValueError):
        reference.equivariant_linear(x, x[..., :2], w, None)
    with pytest.raises(TypeError):
        reference.equivariant_linear(x.float(), x.float(), w, None)
    with pytest.raises(ValueError):
        reference.equivariant_linear(x, x, w, torch.zeros(3))


def test_radial_basis_vanishes_smoothly_at_cutoff():
    d = torch.tensor([4.999999, 5.0, 5.5], requires_grad=True)
    b = reference.radial_basis(d, 8, 5.0)
    assert b.abs().max() < 1e-10
    (g,) = torch.autograd.grad(b.sum(), d)
    assert g.abs().max() < 1e-8
