import math

import numpy as np
import pytest
import torch

from ecekern import so3
from ecekern.testing import random_rotation

G = lambda s: torch.Generator().manual_seed(s)

pytestmark = pytest.mark.usefixtures("float64_default")


def _sphere_quadrature(n: int):
    """Gauss-Legendre in cos(theta) times uniform in phi: exact to degree < 2n."""
    x, w = np.polynomial.legendre.leggauss(n)
    phi = np.arange(2 * n) * (2 * np.pi / (2 * n))
    ct, ph = np.meshgrid(x, phi, indexing="ij")
    st = np.sqrt(1 - ct**2)
    pts = np.stack([st * np.cos(ph), st * np.sin(ph), ct], -1).reshape(-1, 3)
    wts = (w[:, None] * np.full(2 * n, 2 * np.pi / (2 * n))[None, :]).reshape(-1)
    return torch.tensor(pts), torch.tensor(wts)


@pytest.mark.parametrize("lmax", [0, 1, 2, 4, 6])
def test_spherical_harmonics_orthonormal(lmax):
    pts, w = _sphere_quadrature(lmax + 2)
    Y = so3.spherical_harmonics(lmax, pts)
    gram = Y.T @ (w[:, None] * Y)
    torch.testing.assert_close(
        gram, torch.eye(so3.n_components(lmax)), atol=1e-13, rtol=0
    )


def test_degree_one_is_y_z_x():
    v = torch.tensor([[0.3, -0.5, 0.8]])
    Y = so3.spherical_harmonics(1, v, normalize=False)
    c = math.sqrt(3 / (4 * math.pi))
    torch.testing.assert_close(Y[0, 1:], c * torch.tensor([-0.5, 0.8, 0.3]))
    torch.testing.assert_close(Y[0, 0], torch.tensor(1 / math.sqrt(4 * math.pi)))


def test_spherical_harmonics_smooth_at_poles():
    v = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, -1.0]], requires_grad=True)
    Y = so3.spherical_harmonics(4, v)
    assert torch.isfinite(Y).all()
    (g,) = torch.autograd.grad(Y.sum(), v)
    assert torch.isfinite(g).all()


@pytest.mark.parametrize("lmax", [1, 2, 3, 4])
def test_wigner_D_equivariance(lmax):
    g = G(lmax)
    for _ in range(3):
        R = random_rotation(g)
        v = torch.randn(20, 3, generator=g)
        D = so3.wigner_D(lmax, R)
        lhs = so3.spherical_harmonics(lmax, v @ R.T)
        rhs = so3.spherical_harmonics(lmax, v) @ D.T
        torch.testing.assert_close(lhs, rhs, atol=1e-13, rtol=0)


@pytest.mark.parametrize("lmax", [2, 4])
def test_wigner_D_orthogonal_representation_block_diagonal(lmax):
    g = G(10 + lmax)
    R1, R2 = random_rotation(g), random_rotation(g)
    D1, D2 = so3.wigner_D(lmax, R1), so3.wigner_D(lmax, R2)
    S = so3.n_components(lmax)
    torch.testing.assert_close(D1 @ D1.T, torch.eye(S), atol=1e-13, rtol=0)
    torch.testing.assert_close(so3.wigner_D(lmax, R1 @ R2), D1 @ D2, atol=1e-13, rtol=0)
    torch.testing.assert_close(
        so3.wigner_D(lmax, torch.eye(3)), torch.eye(S), atol=1e-13, rtol=0
    )
    l_of_s = so3.lm_tables(lmax).l_of_s
    off_block = l_of_s[:, None] != l_of_s[None, :]
    assert D1[off_block].abs().max() < 1e-13


def test_wigner_D_batched_and_float32():
    g = G(3)
    Rs = torch.stack([random_rotation(g) for _ in range(5)]).reshape(5, 1, 3, 3)
    D64 = so3.wigner_D(3, Rs)
    assert D64.shape == (5, 1, 16, 16)
    D32 = so3.wigner_D(3, Rs.float())
    assert D32.dtype == torch.float32
    assert (D32.double() - D64).abs().max() < 1e-5


def _directions(g):
    v = torch.randn(64, 3, generator=g)
    special = torch.tensor(
        [
            [0, 0, 1.0],
            [0, 0, -1.0],
            [1e-9, 0, -1.0],
            [0, 1e-9, 1.0],
            [1.0, 0, 0],
            [0, 1.0, 1e-12],
        ]
    )
    return torch.cat([v, special])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_edge_rotations_align_every_direction(dtype):
    v = _directions(G(4)).to(dtype)
    R = so3.edge_rotations(v)
    u = v / v.norm(dim=-1, keepdim=True)
    z = torch.zeros_like(u)
    z[:, 2] = 1
    tol = 1e-14 if dtype == torch.float64 else 1e-6
    assert (torch.einsum("eij,ej->ei", R, u) - z).abs().max() < 4 * tol
    eye = torch.eye(3, dtype=dtype)
    assert (R @ R.transpose(1, 2) - eye).abs().max() < 4 * tol
    assert (torch.linalg.det(R) - 1).abs().max() < 4 * tol


def test_edge_frames_put_the_edge_on_the_polar_axis():
    v = _directions(G(5))
    D = so3.edge_frames(3, v)
    Yu = so3.spherical_harmonics(3, v)
    Yz = so3.spherical_harmonics(3, torch.tensor([[0.0, 0.0, 1.0]]))
    torch.testing.assert_close(
        torch.einsum("est,et->es", D, Yu), Yz.expand_as(Yu), atol=1e-13, rtol=0
    )


def test_edge_frames_gradcheck():
    g = G(6)
    v = torch.randn(5, 3, generator=g)
    v[:, 2] = (
        v[:, 2].abs() + 0.2
    )  # one gauge branch (the gauge is discontinuous at u_z=0)
    w = torch.cat([v[:3], -v[3:]])  # and the other
    assert torch.autograd.gradcheck(
        lambda x: so3.edge_frames(2, x), (w.requires_grad_(),)
    )
    gauge = torch.rand(5, generator=g, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, a: so3.edge_frames(2, x, a), (w, gauge))


def test_lm_tables():
    t = so3.lm_tables(2, 1)
    assert t.S == 9 and t.n_ang == 2
    assert t.cos_index.tolist() == [[0, 9], [2, 3], [6, 7]]
    assert t.sin_index.tolist() == [[9, 9], [9, 1], [9, 5]]
    # |m| = 2 components (s = 4, 8) are dropped by M = 1
    assert t.pack_index[4] == t.pack_index[8] == 2 * 3 * 2
    assert t.m0_rows.tolist() == [0, 2, 2, 2, 6, 6, 6, 6, 6]


@pytest.mark.parametrize(
    "call, err",
    [
        (lambda: so3.spherical_harmonics(2, torch.zeros(4, 2)), ValueError),
        (
            lambda: so3.spherical_harmonics(2, torch.zeros(4, 3, dtype=torch.long)),
            TypeError,
        ),
        (lambda: so3.spherical_harmonics(-1, torch.zeros(4, 3)), ValueError),
        (lambda: so3.spherical_harmonics(2.0, torch.zeros(4, 3)), ValueError),
        (lambda: so3.wigner_D(2, torch.zeros(3, 4)), ValueError),
        (lambda: so3.edge_rotations(torch.zeros(4, 3, 1)), ValueError),
        (
            lambda: so3.edge_rotations(torch.ones(4, 3), gauge=torch.zeros(3)),
            ValueError,
        ),
        (lambda: so3.LMTables(2, 3), ValueError),
        ([1, 2, 3], TypeError),
    ],
)
def test_bad_inputs(call, err):
    if isinstance(call, list):
        call = lambda c=call: so3.spherical_harmonics(1, c)
    with pytest.raises(err):
        call()
