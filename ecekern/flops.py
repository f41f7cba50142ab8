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

__all__ = ["STAGES", "counted_flops", "stage_costs", "step_flops"]


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


#: The stages of a force step as the model names them (``ece::<stage>`` ranges), in
#: order; ``radial_modulation`` and ``aggregate`` are the reference's own passes
#: (chapter 3 folds them into rotate and unrotate).
STAGES = (
    "geometry",
    "edge_frames",
    "radial",
    "gie",
    "rotate_and_select",
    "radial_modulation",
    "mixing_stack",
    "pack_and_unrotate",
    "aggregate",
    "node_update",
    "readout",
)


def stage_costs(
    config: ECEConfig, n_atoms: int, n_edges: int, word: int = 4, index: int = 8
) -> dict[str, dict[str, int]]:
    """``{stage: {"flop", "bytes"}}`` of one force step (forward and backward) of
    ``ECEModel(config)``, stage by stage (:data:`STAGES`, every layer summed).

    FLOP as :func:`step_flops` (``linears`` in the mixing stack, ``rotations`` half
    in rotate and half in unrotate, ``radial``, ``nodes`` split into node update and
    readout). Bytes: the fewest a stage moves through DRAM when it runs as its own
    pass, ``word`` bytes a value and ``index`` an index, its inputs read once and its
    outputs written once, per edge (``P = 2 S n_ang`` packed frame values, ``R =
    L C + T F`` radial outputs, ``X = 2 F n_ang`` rotated values, ``Y = 2 C (L + 1)
    n_ang`` stack outputs) and per atom (``h``: ``S C``):

    * geometry (and the reference's edge_frames, 0 here): forward reads src, dst and
      the shift (5 indices) and writes P, Z (S - 1), d and env; backward reads the
      same indices and the gradients of what it wrote, writes ``g_r`` (3) and reads
      it twice more in the per-atom reduction;
    * radial: forward reads d, writes R; backward reads ``g_R`` and d, writes
      ``g_d``;
    * gie: forward reads Z, the radial's L C values and dst, writes h; backward
      reads ``g_h`` and Z and the L C values, writes ``g_Z`` and their gradient;
    * per layer, rotate_and_select: forward reads P, the layer's F radial values
      and two h rows (from L2: counted once per atom), writes X; backward reads
      ``g_X``, P and the F values, writes ``g_P``, the F gradients and ``g_h``;
      radial_modulation: 0 (folded into the store);
    * per layer, mixing_stack: forward reads X, writes Y; backward reads ``g_Y``
      and X (kept or recomputed), writes ``g_X``;
    * per layer, pack_and_unrotate (with aggregate, 0 here): forward reads Y, P,
      env and dst, writes the per-atom update; backward reads the update's gradient
      (per atom), Y and P, writes ``g_Y``, ``g_P`` and ``g_env``;
    * per layer, node_update: per atom, reads h and the update, writes h; the
      backward reads ``g_h`` and writes the two gradients;
    * readout: per atom, reads ``h_0`` (C), writes the energy; backward the same.

    Elementwise FLOP (the Wigner blocks, envelopes, gates) are left out, as in
    :func:`step_flops`: these stages are bound by their bytes."""
    f = step_flops(config, n_atoms, n_edges)
    c, E, N = config, n_edges, n_atoms
    C, L, S, F, T, n_ang = c.channels, c.lmax, c.S, c.F, c.n_interactions, c.n_ang
    P, R, X = 2 * S * n_ang, L * C + T * F, 2 * F * n_ang
    Y, h = 2 * C * (L + 1) * n_ang, S * C
    w, i = word, index
    per_edge = {
        "geometry": (5 * i + (P + S - 1 + 2) * w)
        + (5 * i + (P + S - 1 + 2 + 3) * w)
        + 2 * 3 * w,
        "radial": (1 + R) * w + (R + 1 + 1) * w,
        "gie": (S - 1 + L * C) * w + i + 2 * (S - 1 + L * C) * w,
        "rotate_and_select": T * ((P + F + X) * w + (X + P + F + P + F) * w),
        "mixing_stack": T * ((X + Y) * w + (Y + X + X) * w),
        "pack_and_unrotate": T * ((Y + P + 1) * w + i + (Y + P + Y + P + 1) * w),
    }
    per_atom = {
        "gie": 2 * h * w,
        "rotate_and_select": T * 2 * h * w,
        "pack_and_unrotate": T * 2 * h * w,
        "node_update": T * 6 * h * w,
        "readout": 2 * (C + 1) * w,
        "geometry": 2 * 3 * w,
    }
    flop = {
        "rotate_and_select": f["rotations"] // 2,
        "pack_and_unrotate": f["rotations"] - f["rotations"] // 2,
        "mixing_stack": f["linears"],
        "radial": f["radial"],
        "readout": N * 2 * 2 * (C * c.readout_hidden + c.readout_hidden),
    }
    flop["node_update"] = f["nodes"] - flop["readout"]
    return {
        s: {"flop": flop.get(s, 0),
            "bytes": E * per_edge.get(s, 0) + N * per_atom.get(s, 0)}
        for s in STAGES
    }  # fmt: skip


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
