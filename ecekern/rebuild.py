"""Saved-tensor hooks that keep a recipe instead of an activation (chapter 6).

The model wraps the mixing stack in :class:`RebuiltInBackward` when
``cohort_recompute`` is on: the stack's input rows are not kept for the backward but
made again there by the rotation that made them (chapter 3's kernel), one more pass
over the edges a layer for ``2 E F n_ang`` values less kept.
"""

from __future__ import annotations

import torch

__all__ = ["RebuiltInBackward"]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same values in memory (a reshape of one is
    another tensor object over the same storage)."""
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


class RebuiltInBackward:
    """Saved-tensor hooks that keep a recipe instead of the stack's input rows.

    While the hooks are on, a tensor saved for the backward that is ``x_cos`` or
    ``x_sin`` is stored as its index; the first unpack calls ``rebuild()`` (the
    rotation that made them: chapter 3's kernel, one more pass over the edges) and
    hands out its rows, and the rebuilt pair is dropped once both are out. Under a
    second derivative (grad mode on in the backward) the rebuild is differentiable,
    so the second derivative flows through it to h and the radial weights as it
    would have through the kept rows. The rotation has no reductions across
    programs, so the rebuilt rows are the kept ones bit for bit.

    Saves ``2 E F n_ang`` values a layer (the stack keeps only x with
    ``cohort_recompute``), for one rotation a layer more in the backward."""

    def __init__(self, x_cos, x_sin, rebuild):
        self.x, self.rebuild, self.rows = (x_cos, x_sin), rebuild, None
        self.packed = self.out = 0

    def pack(self, t):
        for i, x in enumerate(self.x):
            if x is not None and _same(t, x):
                self.packed += 1
                return (i, tuple(t.shape))
        return t

    def unpack(self, saved):
        if isinstance(saved, torch.Tensor):
            return saved
        i, shape = saved
        if self.rows is None:
            if torch.is_grad_enabled():  # a second derivative: through the rebuild
                self.rows = self.rebuild()
            else:
                with torch.no_grad():
                    self.rows = self.rebuild()
        t = self.rows[i].reshape(shape)
        self.out += 1
        if self.out % self.packed == 0:  # every saved one handed out: drop them
            self.rows = None
        return t

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        # the recipe outlives the forward, the rows must not; and the hooks object
        # holds this one's methods: kept, it would make a reference cycle that only
        # the garbage collector frees, with h and rho in it, step after step
        hooks, self.hooks, self.x = self.hooks, None, (None, None)
        return hooks.__exit__(*exc)
