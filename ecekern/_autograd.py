"""Autograd helpers shared by the chapters' custom ops.

A force step asks ``torch.autograd.grad(energy, positions)``: the engine runs only
the nodes on the way to the positions, but a custom ``Function``'s
``ctx.needs_input_grad`` still says True for every parameter that requires grad.
:func:`engine_uses` asks the running engine whether it will execute a node, so an op
can skip its weight gradients in a force step.
"""

from __future__ import annotations

import torch

__all__ = ["engine_uses", "grad_node"]


def grad_node(t: torch.Tensor):
    """The autograd node that receives ``t``'s gradient (for a leaf, its
    ``AccumulateGrad``); None if t does not require grad."""
    if not t.requires_grad:
        return None
    if t.grad_fn is not None:
        return t.grad_fn
    with torch.enable_grad():
        return t.view_as(t).grad_fn.next_functions[0][0]


def engine_uses(node) -> bool:
    """Whether the running backward pass will execute ``node``: False when
    ``torch.autograd.grad`` asks for other inputs only (forces ask for positions, not
    weights), True for ``.backward()`` and wherever PyTorch cannot say."""
    will = getattr(torch._C, "_will_engine_execute_node", None)
    if node is None or will is None:
        return node is not None
    try:
        return bool(will(node))
    except RuntimeError:  # not inside a backward pass of the autograd engine
        return True
