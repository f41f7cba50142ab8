"""How every fused op of the chapters meets autograd, ``torch.library`` and
``torch.compile``: one style, written once here.

The style: **library ops always, autograd around them.** Each fused op is a
``torch.autograd.Function`` whose ``forward`` and ``backward`` call ``torch.library``
ops, in eager mode and while compiling alike (no second path for either):

* :func:`library_op` registers one launcher as the op ``ecekern::<name>`` with its
  fake implementation (shapes only): a ``triton_op`` on a GPU with real Triton, so
  inductor traces the Triton launches inside (each through :func:`wrap_triton`); a
  ``custom_op`` (opaque to inductor) in Triton's interpreter, without Triton, with
  ``ECEKERN_OP=custom_op``, or for a launcher inductor cannot trace
  (``opaque=True``: Gluon kernels, host-side TMA descriptors, a launcher that
  chooses its kernel at run time).
* An op's outputs alias neither each other nor its inputs (``torch.library``'s rule):
  two row tensors that share storage, the cos and sin of a planes pair
  (:mod:`ecekern._planes`), leave the op as the one tensor that holds both, and the
  Function returns the two views.
* Launch configurations (dataclasses) are not op arguments: an op takes the fields
  it needs as ints (edge frames), or runs the library's launch (zonal; its launchers
  take ``launch=`` for the captures' sweeps, outside the ops).
* The ops carry no autograd formula (no ``register_autograd``); the Function's
  ``backward`` calls the backward ops. Three things need the Function: (1) it gets
  each output's gradient as it comes, so a planes pair's two cotangents reach the
  kernel as they are (views of one op output would have autograd build a zero-filled
  copy of the whole pair per view and add them first: several times the rows'
  bytes); (2) :func:`engine_uses` lets it skip gradients the engine will not use (a
  force step asks for positions, not weights); (3) with grad mode on in the backward
  (a second derivative) it picks a differentiable formula: the ops' own Functions
  again (zonal, linear) or differentiable PyTorch (:func:`torch_grads`, edge frames).

Under ``torch.compile`` Dynamo traces the Functions; the ops are the graph's nodes
(inductor inlines a ``triton_op``'s launches, a ``custom_op`` stays one call). A
Function's ``needs_input_grad`` says True for every parameter that requires grad;
:func:`engine_uses` asks the running engine instead, in eager mode (the engine's plan
is not traceable: compiled backwards compute every gradient asked for).
"""

from __future__ import annotations

import os

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ._triton import AVAILABLE, INTERPRET

__all__ = [
    "REGISTRATION",
    "engine_uses",
    "grad_node",
    "library_op",
    "torch_grads",
    "wrap_triton",
]

#: How the ops are registered (``ECEKERN_OP``): ``triton_op`` (the default, where
#: real Triton runs on a GPU) or ``custom_op`` (opaque to inductor, everywhere). In
#: the interpreter, or without Triton, the ops are always custom ops.
REGISTRATION = os.environ.get("ECEKERN_OP", "triton_op")
if REGISTRATION not in ("custom_op", "triton_op"):
    raise ValueError(f"ECEKERN_OP={REGISTRATION!r}: custom_op or triton_op")
if not AVAILABLE or INTERPRET:
    REGISTRATION = "custom_op"


def library_op(name: str, fake, *, opaque: bool = False):
    """Decorator: register ``fn`` as ``ecekern::<name>`` (no mutated arguments),
    ``triton_op`` where ``REGISTRATION`` says so and not ``opaque``, else
    ``custom_op``, with ``fake`` as its fake implementation. The schema comes from
    fn's annotations."""

    def register(fn):
        qualname = f"ecekern::{name}"
        if REGISTRATION == "triton_op" and not opaque:
            op = torch.library.triton_op(qualname, mutates_args=())(fn)
        else:
            op = torch.library.custom_op(qualname, mutates_args=())(fn)
        op.register_fake(fake)
        return op

    return register


def wrap_triton(kernel):
    """``torch.library.wrap_triton(kernel)`` while a triton_op is traced (a compile
    session, or a dispatch mode such as the fake or functional tensors' active), so
    that the launch is a graph node; the kernel itself in eager mode, where
    ``wrap_triton`` is a pass-through inside a triton_op anyway and a launcher called
    on its own (a capture's timing) launches directly."""
    if REGISTRATION == "triton_op" and (
        torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None
    ):
        return torch.library.wrap_triton(kernel)
    return kernel


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


def torch_grads(fn, inputs, needs, grads):
    """The gradients of ``fn(*inputs)`` against ``grads``, differentiable (a
    backward's second-derivative formula in PyTorch); None where not needed.

    Partial derivatives: ``fn`` runs on aliases of the inputs (``view_as``), so an
    input computed from another (the unrotation's y from the rotation of the same
    frame tiles P) adds no path through its own history to the other's gradient;
    the engine adds that path once, through the other Function's backward. The
    aliases stay differentiable in the inputs (the second derivative)."""
    with torch.enable_grad():
        inputs = [t.view_as(t) if isinstance(t, torch.Tensor) and t.requires_grad
                  else t for t in inputs]  # fmt: skip
        want = [t for t, need in zip(inputs, needs) if need and t is not None]
        out = fn(*inputs)
        out = out if isinstance(out, tuple) else (out,)
        got = torch.autograd.grad(out, want, grads, create_graph=True,
                                  allow_unused=True)  # fmt: skip
    it = iter(got)
    return tuple(
        next(it) if need and t is not None else None for t, need in zip(inputs, needs)
    )
