"""FLOP per force step: a model of the book's step, and a counter for any step.

:func:`step_flops` counts the multiply-adds (2 FLOP each) of one force step (the
energy and ``dE/dx``) of :class:`~ecekern.ECEModel`, the matrix products of the
reference's stages (:mod:`ecekern.reference`), per edge or per atom. With ``E``
edges, ``N`` atoms, ``C`` channels, ``L``, ``S = (L+1)^2``, ``n_ang = M+1``, ``F =
2C(L+1)``, ``K`` gated layers, ``T`` interaction layers, ``H`` the radial MLP's
width, ``n_radial = LC + TF``, ``Hr`` the readout's width, the forward's:

* ``linears``: per edge and layer, cos and sin, ``2 * 2 n_ang (K F F + F C(L+1))``
  (:func:`ecekern.reference.equivariant_linear`, the K gated ``F -> F`` and the
  output ``F -> C(L+1)``);
* ``rotations``: per edge and layer, ``2 S S 2C`` (rotate and select, ``D_e @
  [h_dst | h_src]``) and ``2 S S C`` (pack and unrotate, ``D_e^T @ loc``);
* ``radial``: per edge, ``2 (n_rbf H + H H + H n_radial)``;
* ``nodes``: per atom and layer ``2 S C C`` (node update), and per atom ``2 (C Hr +
  Hr)`` (readout).

The backward of a force step needs the gradient of the energy with respect to the
positions only, never the weights': a product of a weight and an activation costs
its forward once more (the activation's gradient), one of two position-dependent
factors (the rotations: ``D_e`` and the features) twice more. So the step is
``2x`` the forward for the linears, the radial MLP and the nodes, ``3x`` for the
rotations. Elementwise work (gates, envelopes, gathers, scatters, the Wigner
blocks) is left out: it is bandwidth, not arithmetic. The fast paths of later
chapters compute the same products (chapter 6's 3xTF32 does three TF32 products
per product: its arithmetic, not its FLOP, triples).

:func:`counted_flops` counts what ``torch.utils.flop_counter.FlopCounterMode``
sees in one call of a step (matrix products and convolutions of PyTorch ops; a
custom kernel's work is invisible to it).
"""

from __future__ import annotations

from .config import ECEConfig

__all__ = ["counted_flops", "step_flops"]


def step_flops(config: ECEConfig, n_atoms: int, n_edges: int) -> dict[str, int]:
    """FLOP of one force step of ``ECEModel(config)`` on a graph of ``n_atoms``
    atoms and ``n_edges`` edges (module docstring): ``{"linears", "rotations",
    "radial", "nodes", "total"}``, each the step's (forward and backward)."""
    if not isinstance(config, ECEConfig):
        raise TypeError(f"config must be an ECEConfig, got {type(config).__name__}")
    for name, v in (("n_atoms", n_atoms), ("n_edges", n_edges)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    c = config
    C, L, S, F, K, T = c.channels, c.lmax, c.S, c.F, c.n_gated, c.n_interactions
    H, Hr, Cout = c.radial_hidden, c.readout_hidden, C * (L + 1)
    n_radial = L * C + T * F
    fwd = {
        "linears": n_edges * T * 2 * 2 * c.n_ang * (K * F * F + F * Cout),
        "rotations": n_edges * T * (2 * S * S * 2 * C + 2 * S * S * C),
        "radial": n_edges * 2 * (c.n_rbf * H + H * H + H * n_radial),
        "nodes": n_atoms * (T * 2 * S * C * C + 2 * (C * Hr + Hr)),
    }
    out = {k: v * (3 if k == "rotations" else 2) for k, v in fwd.items()}
    out["total"] = sum(out.values())
    return out


def counted_flops(step) -> int:
    """The FLOP of one call of ``step()`` (a callable of no arguments) by the
    formulas of ``torch.utils.flop_counter`` (FlopCounterMode's), op by op as it
    dispatches. FlopCounterMode itself is not used: its module hooks refuse
    ``torch.autograd.grad``, which a force step calls."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    if not callable(step):
        raise TypeError(f"step must be callable, got {type(step).__name__}")

    class _Count(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            count = flop_registry.get(func._overloadpacket)
            if count is not None:
                _Count.total += count(*args, **kwargs, out_val=out)
            return out

    with torch.inference_mode(False), _Count():
        step()
    return int(_Count.total)
