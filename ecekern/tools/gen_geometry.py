"""Writes :mod:`ecekern.step.wigner` and its siblings: the packed Wigner tiles of
an edge frame as straight-line Triton code, and their adjoint.

``python -m ecekern.tools.gen_geometry`` (needs sympy) regenerates the file; a test
checks that the file on disk is what this script writes.

The algebra, once, in exact arithmetic (sympy):

* ``D_l(R)``, the real Wigner block of degree l (:func:`ecekern.so3.wigner_D`'s
  convention), as a polynomial in the nine entries of R: from ``Y_l(R p) = D_l(R)
  Y_l(p)`` at ten fixed unit points p with rational coordinates,
  ``D_l = (pinv(Y_l(P)) Y_l(R P))^T``. The polynomial agrees with the Wigner block
  on every rotation; off the rotations it is some extension, which is all a
  derivative along a path of rotations needs.
* the packed tiles ``P[s, t, m] = D[row_t(l(s), m), s]``
  (:func:`ecekern.edge_frame.pack`), slot by slot: zero slots are not written as
  expressions (the kernel stores zeros there);
* the adjoint ``dR_j = sum_k dP_k dP_k/dR_j``, and ``du_i = sum_j dR_j dR_j/du_i``
  through the edge rotation ``R(u) = F_s (I + K + K^2 / (1 + s u_z))``
  (:func:`ecekern.so3.edge_rotations`; ``s = sign(u_z)``, ``K = [v]_x``,
  ``v = u x (s z)``, ``F_s = diag(1, s, s)``), with ``s`` a symbol and ``s^2 = 1``.

Common subexpressions are shared (``sympy.cse``) and printed as Triton statements
on ``[BLOCK]`` tensors; constants are printed with 17 significant digits.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

STEP = Path(__file__).resolve().parents[1] / "step"
#: The files written and the (L, M) variants in each (the model's L = 1 and 2, every
#: M <= L; the first file also holds the edge rotation and its adjoint), so that no
#: file passes 600 lines.
FILES = {
    "wigner.py": ((1, 0), (1, 1), (2, 0)),
    "wigner_l2m1.py": ((2, 1),),
    "wigner_l2m2.py": ((2, 2),),
}


def _sympy():
    import sympy

    return sympy


def _harmonic(sp, l: int, m: int, x, y, z):
    """so3.spherical_harmonics' component (l, m) for a unit vector (x, y, z)."""
    a = abs(m)
    c, si = sp.Integer(1), sp.Integer(0)
    for _ in range(a):
        c, si = c * x - si * y, si * x + c * y
    q = {a: sp.Integer(math.prod(range(1, 2 * a, 2)) if a > 0 else 1)}
    if a + 1 <= l:
        q[a + 1] = (2 * a + 1) * z * q[a]
    for k in range(a + 2, l + 1):
        q[k] = ((2 * k - 1) * z * q[k - 1] - (k + a - 1) * q[k - 2]) / (k - a)
    n = sp.sqrt(
        sp.Rational(2 * l + 1) / (4 * sp.pi) * sp.factorial(l - a) / sp.factorial(l + a)
    )
    if a > 0:
        n *= sp.sqrt(2)
    return n * q[l] * (c if m >= 0 else si)


def _points(sp):
    r = sp.Rational
    return [(1, 0, 0), (0, 1, 0), (0, 0, 1), (r(3, 5), r(4, 5), 0),
            (0, r(3, 5), r(4, 5)), (r(4, 5), 0, r(3, 5)),
            (r(2, 3), r(2, 3), r(1, 3)), (r(2, 3), -r(1, 3), r(2, 3)),
            (-r(1, 3), r(2, 3), r(2, 3)), (r(3, 5), 0, -r(4, 5))]  # fmt: skip


def wigner_blocks(L: int):
    """``(R, {l: D_l})``: the symbols r0..r8 (row-major R) and each block."""
    sp = _sympy()
    R = sp.Matrix(3, 3, sp.symbols("r0:9"))
    blocks = {}
    for l in range(L + 1):
        ms = range(-l, l + 1)
        A = sp.Matrix([[_harmonic(sp, l, m, *p) for m in ms] for p in _points(sp)])
        B = sp.Matrix(
            [
                [_harmonic(sp, l, m, *(R * sp.Matrix(p))) for m in ms]
                for p in _points(sp)
            ]  # fmt: skip
        )
        pinv = (A.T * A).inv() * A.T
        blocks[l] = (pinv * B).T.applyfunc(sp.expand)
    return R, blocks


def slots(L: int, M: int):
    """``[(k, l, row, col)]``: the packed slot k = (s*2 + t)*n_ang + m of
    ``P (S, 2, n_ang)`` that is not zero, with its degree and its entry of D_l."""
    n_ang, out = M + 1, []
    for l in range(L + 1):
        for s in range(l * l, (l + 1) ** 2):
            for t in range(2):
                for m in range(min(l, M) + 1):
                    if t == 1 and m == 0:
                        continue
                    row = l + m if t == 0 else l - m  # within the block
                    out.append(((s * 2 + t) * n_ang + m, l, row, s - l * l))
    return out


def _odd(sp, e, s):
    """``e`` expanded with ``s^2 = 1``."""
    e = sp.expand(e)
    return e.replace(lambda x: x.is_Pow and x.base == s,
                     lambda x: s ** (int(x.exp) % 2))  # fmt: skip


def rotation(sp):
    """``(u, s, w, R(u, s, w))``: the edge rotation of so3.edge_rotations, with
    ``w = 1 / (1 + s u_z)`` a symbol of its own (``dw/du_z = -s w^2``), so that
    every entry is a polynomial."""
    ux, uy, uz, s, w = sp.symbols("ux uy uz s w", real=True)
    v = sp.Matrix([s * uy, -s * ux, 0])
    K = sp.Matrix([[0, -v[2], v[1]], [v[2], 0, -v[0]], [-v[1], v[0], 0]])
    R = sp.diag(1, s, s) * (sp.eye(3) + K + K * K * w)
    return (ux, uy, uz), s, w, R.applyfunc(lambda e: _odd(sp, e, s))


class _Printer:
    """sympy expressions as Triton expressions on tensors."""

    def __init__(self, sp):
        from sympy.printing.str import StrPrinter

        class P(StrPrinter):
            def _print_Float(self, e):
                return repr(float(e))

            def _print_Rational(self, e):
                return repr(float(e))

            def _print_Integer(self, e):
                return f"{int(e)}.0"

            def _print_Pow(self, e):
                b, x = e.args
                if not x.is_Integer or x == 0:
                    raise ValueError(f"power {x} is not printed")
                base = self.parenthesize(b, 100)
                prod = " * ".join([base] * abs(int(x)))
                return prod if x > 0 else f"1.0 / ({prod})"

        self.p = P({"full_prec": False})
        self.sp = sp

    def __call__(self, e) -> str:
        return self.p.doprint(e)


def _numeric(sp, e):
    """Exact constants (sqrt(pi) and the like) evaluated to floats."""
    return sp.expand(sp.N(e, 20))


def _cse_lines(sp, exprs, names, prefix, like="r0", indent="    "):
    """Statements for ``names = exprs``, common subexpressions shared; a constant
    is broadcast to a tensor like ``like`` (a jit function returns tensors)."""
    pr = _Printer(sp)
    subs, reduced = sp.cse([_numeric(sp, e) for e in exprs],
                           symbols=sp.numbered_symbols(prefix))  # fmt: skip
    lines = [f"{indent}{a} = {pr(b)}" for a, b in subs]
    for n, e in zip(names, reduced):
        text = pr(e)
        if e.is_Number:
            text = f"tl.zeros_like({like}) + {text}"
        lines.append(f"{indent}{n} = {text}")
    return lines


def _variant(sp, R, blocks, L: int, M: int) -> tuple[str, str]:
    """The forward tile and the adjoint bodies of one (L, M)."""
    sl = slots(L, M)
    n_ang, S = M + 1, (L + 1) ** 2
    vals = [blocks[l][row, col] for _, l, row, col in sl]
    fwd = _cse_lines(sp, vals, [f"p{k}" for k, *_ in sl], "a")
    fwd.append("    zero = tl.zeros_like(r0)")
    nonzero = {k for k, *_ in sl}
    for k in range(S * 2 * n_ang):
        fwd.append(f"    tl.store(p_row + {k}, {f'p{k}' if k in nonzero else 'zero'}, "
                   "mask=mask)")  # fmt: skip
    # the zonal rows: Z[s - 1] = P[s, cos, m = 0]
    fwd += [f"    tl.store(z_row + {t - 1}, p{t * 2 * n_ang}, mask=mask)"
            for t in range(1, S)]  # fmt: skip
    gp = {k: sp.Symbol(f"g{k}") for k, *_ in sl}
    grads = [sum(gp[k] * sp.diff(v, r) for (k, *_), v in zip(sl, vals)) for r in R]
    used = set().union(*(sp.sympify(e).free_symbols for e in grads))
    loads = [f"    g{k} = tl.load(gp_row + {k}, mask=mask, other=0.0)"
             for k, *_ in sl if gp[k] in used]  # fmt: skip
    loads += [f"    g{t * 2 * n_ang} += tl.load(gz_row + {t - 1}, mask=mask, other=0.0)"
              for t in range(1, S) if gp[t * 2 * n_ang] in used]  # fmt: skip
    bwd = loads + _cse_lines(sp, grads, [f"q{j}" for j in range(9)], "b")
    return "\n".join(fwd), "\n".join(bwd)


_HEADER = '''"""Generated by ``python -m ecekern.tools.gen_geometry``: do not edit.

The packed Wigner tiles of an edge frame, ``P[e, s, t, m] = D_e[row_t(l(s), m), s]``
(:func:`ecekern.edge_frame.pack` of :func:`ecekern.so3.edge_frames`), as
straight-line code in the nine entries ``r0..r8`` of the edge rotation (row-major),
one function per (L, M); and the adjoints: ``dR = sum_k dP_k dP_k/dR`` and
``du = dR dR/du``. Each forward stores the slots that are not zero at
``p_row + k``, ``k = (s * 2 + t) * n_ang + m`` (the zero slots: the caller).
"""

from .._triton import tl, triton

'''


def render(name: str) -> str:
    """The text of one generated file (:data:`FILES`)."""
    sp = _sympy()
    out = [_HEADER]
    if name == "wigner.py":
        out += _rotation_functions(sp)
    for L, M in FILES[name]:
        R, blocks = wigner_blocks(L)
        fwd, bwd = _variant(sp, R, blocks, L, M)
        args = "r0, r1, r2, r3, r4, r5, r6, r7, r8"
        out.append(f"@triton.jit\ndef packed_L{L}M{M}(p_row, z_row, mask, {args}):\n"
                   f'    """P (every slot) at p_row + k and Z at z_row, L = {L}, '
                   f'M = {M}."""\n'
                   f"{fwd}\n\n")  # fmt: skip
        out.append(f"@triton.jit\ndef adjoint_L{L}M{M}(gp_row, gz_row, mask, {args}):\n"
                   f'    """dLoss/dR from dP at gp_row + k and dZ at gz_row, L = {L}, '
                   f'M = {M}."""\n'
                   f"{bwd}\n"
                   "    return q0, q1, q2, q3, q4, q5, q6, q7, q8\n\n")  # fmt: skip
    return "\n".join(out).rstrip() + "\n"


def _rotation_functions(sp) -> list[str]:
    out = []
    (ux, uy, uz), s, w, Rm = rotation(sp)
    gR = [sp.Symbol(f"q{j}") for j in range(9)]
    dw = {ux: 0, uy: 0, uz: -s * w**2}
    du = [_odd(sp, sum(gR[j] * (sp.diff(Rm[j], u) + sp.diff(Rm[j], w) * dw[u])
                       for j in range(9)), s) for u in (ux, uy, uz)]  # fmt: skip
    out.append(
        "@triton.jit\ndef rotation(ux, uy, uz, s, w):\n"
        '    """The edge rotation R(u) (so3.edge_rotations), row-major;\n'
        '    s = sign(u_z) (+1 at 0), w = 1 / (1 + s u_z)."""'
    )
    out += _cse_lines(sp, list(Rm), [f"r{j}" for j in range(9)], "c", like="ux")
    out.append("    return " + ", ".join(f"r{j}" for j in range(9)) + "\n\n")
    out.append("@triton.jit\ndef rotation_adjoint(ux, uy, uz, s, w, q0, q1, q2, "
               "q3, q4, q5, q6, q7, q8):\n"
               '    """dLoss/du from dLoss/dR (row-major) through R(u)."""'
               )  # fmt: skip
    out += _cse_lines(sp, du, ["gx", "gy", "gz"], "c", like="ux")
    out.append("    return gx, gy, gz\n\n")
    return out


def formatted(text: str) -> str:
    """``text`` through ``ruff format`` (the repository's settings)."""
    import subprocess

    root = STEP.parents[1]
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--stdin-filename",
         str(STEP / "x.py"), "-"],
        input=text, capture_output=True, text=True, check=True, cwd=root,
    )  # fmt: skip
    return out.stdout


def main(argv=None) -> int:
    for name in FILES:
        text = formatted(render(name))
        (STEP / name).write_text(text)
        print(f"wrote {STEP / name} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
