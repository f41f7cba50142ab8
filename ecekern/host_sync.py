"""Find the host synchronisations and host-to-device copies of a piece of PyTorch code.

A *host sync* is an op whose result the CPU must wait for before it can go on: the
value of a tensor turned into a Python number (``.item()``, ``bool(t)``, ``int(t)``,
``if t.any():``), or an output whose size depends on the data (``nonzero``, boolean-
mask indexing, ``unique``, CUDA ``bincount``). On a GPU each one drains the stream:
the CPU stops queueing kernels until the GPU has run everything before it, so the GPU
then idles while the CPU queues the next ones. A *host-to-device copy* of a table
built from Python data (``torch.tensor([...], device="cuda")``) goes through pageable
memory and is synchronous with the host too. Neither can be captured in a CUDA graph.

:class:`HostSyncAudit` records them by op, not by device: it is a
``TorchDispatchMode`` that sees every ATen op, including those of the autograd
backward, and so finds on a CPU the very ops that would synchronise on a GPU::

    with HostSyncAudit() as audit:
        energy, forces = force_step(model, positions, numbers, graph)
    print(audit.table())    # op, where (file:line in ecekern), count
    audit.assert_none()     # AssertionError listing them, if any

On a GPU, ``torch.cuda.set_sync_debug_mode("error")`` is the device's own check; the
tests run both.
"""

from __future__ import annotations

import collections
import os
import traceback
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostSyncAudit", "SyncEvent"]

_aten = torch.ops.aten
# ops whose output size or value the host must read back
_ALWAYS = {
    "_local_scalar_dense": "a tensor read as a Python number (item, bool, int, if)",
    "nonzero": "nonzero: output size depends on the data",
    "argwhere": "argwhere: output size depends on the data",
    "masked_select": "masked_select: output size depends on the data",
    "unique_consecutive": "unique: output size depends on the data",
    "_unique2": "unique: output size depends on the data",
    "unique_dim": "unique: output size depends on the data",
    "bincount": "bincount: CUDA reads max(input) back to size the output",
    "equal": "torch.equal returns a Python bool",
    "is_nonzero": "a tensor read as a Python bool",
    "allclose": "torch.allclose returns a Python bool",
    "_linalg_check_errors": "linalg's error check reads the info tensor back",
    "histc": "CUDA histc reads min and max back",
}
# tensor methods that copy to the host without an ATen op the dispatch mode sees
_HOST_READS = {
    torch.Tensor.tolist: "tolist: a copy to the host",
    torch.Tensor.numpy: "numpy: a copy to the host",
    torch.Tensor.cpu: "cpu: a copy to the host",
    torch.Tensor.__array__: "__array__: a copy to the host",
}
_INDEX_OPS = {"index", "index_put", "index_put_", "_index_put_impl_"}
_PACKAGE = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class SyncEvent:
    """One recorded op: ``kind`` is ``"sync"`` or ``"h2d"``."""

    kind: str
    op: str
    why: str
    where: str


def _where() -> str:
    """The innermost frame in the ecekern package outside this file (or the
    innermost frame outside torch), as ``path:line (function)``."""
    frames = traceback.extract_stack()[:-3]
    pick = None
    for f in reversed(frames):
        path = os.path.abspath(f.filename)
        if path == os.path.abspath(__file__):
            continue
        if path.startswith(_PACKAGE):
            pick = f
            break
        if pick is None and "torch" not in path.split(os.sep):
            pick = f
    if pick is None:
        return "?"
    rel = os.path.relpath(pick.filename, os.path.dirname(_PACKAGE))
    return f"{rel}:{pick.lineno} ({pick.name})"


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(
        isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)
        for t in (indices or ())
    )


def _device_of(x) -> torch.device | None:
    return x.device if isinstance(x, torch.Tensor) else None


class _HostReads(TorchFunctionMode):
    """The methods of :data:`_HOST_READS`, recorded into the audit."""

    def __init__(self, audit):
        super().__init__()
        self.audit = audit

    def __torch_function__(self, func, types, args=(), kwargs=None):
        why = _HOST_READS.get(func)
        if why is not None:
            self.audit._record("sync", func.__name__, why)
        return func(*args, **(kwargs or {}))


class HostSyncAudit(TorchDispatchMode):
    """Record every op that would make the host wait for a CUDA device, and every
    copy of host data to a device, while the context is open.

    ``events`` lists them in order (:class:`~ecekern.host_sync.SyncEvent`); ``syncs``
    and ``h2d`` count them; :meth:`~ecekern.host_sync.HostSyncAudit.table` groups
    them by op and source line. Tensors made from Python data
    (``torch.tensor(...)``, op ``lift_fresh``) are counted as host-to-device copies
    on any device: on the CPU they show where a GPU would copy.
    """

    def __init__(self):
        super().__init__()
        self.events: list[SyncEvent] = []
        self._reads = _HostReads(self)

    def __enter__(self):
        self._reads.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._reads.__exit__(*exc)

    def _record(self, kind, op, why):
        self.events.append(SyncEvent(kind, op, why, _where()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        if name in _ALWAYS:
            self._record("sync", name, _ALWAYS[name])
        elif name in _INDEX_OPS and _has_bool_index(args):
            self._record("sync", name, "boolean-mask indexing: nonzero inside")
        elif name == "repeat_interleave" and kwargs.get("output_size") is None:
            if len(args) == 1 or isinstance(args[1], torch.Tensor):
                self._record("sync", name, "repeat_interleave without output_size")
        elif name in ("lift_fresh", "lift_fresh_copy"):
            self._record("h2d", name, "a tensor built from Python data")
        elif name in ("_to_copy", "copy_"):
            src = _device_of(args[1] if name == "copy_" else args[0])
            dst = (
                _device_of(args[0])
                if name == "copy_"
                else torch.device(kwargs.get("device") or src or "cpu")
            )
            if src is not None and dst is not None and src.type != dst.type:
                kind = "h2d" if src.type == "cpu" else "sync"
                self._record(kind, name, f"copy {src.type} -> {dst.type}")
        return func(*args, **kwargs)

    @property
    def syncs(self) -> int:
        return sum(e.kind == "sync" for e in self.events)

    @property
    def h2d(self) -> int:
        return sum(e.kind == "h2d" for e in self.events)

    def counts(self) -> list[tuple[str, str, str, int]]:
        """``(kind, op, where, count)`` rows, in order of first appearance."""
        c = collections.Counter((e.kind, e.op, e.where) for e in self.events)
        return [(k, op, w, n) for (k, op, w), n in c.items()]

    def table(self) -> str:
        """The :meth:`counts` as aligned text, one line per op and source line."""
        rows = self.counts()
        if not rows:
            return "no host syncs and no host-to-device copies"
        width = max(len(w) for _, _, w, _ in rows)
        return "\n".join(
            f"{k:4s}  {op:20s}  {w:{width}s}  x{n}" for k, op, w, n in rows
        )

    def assert_none(self) -> None:
        """AssertionError listing every recorded op, if there is any."""
        if self.events:
            raise AssertionError(
                f"{self.syncs} host syncs and {self.h2d} host-to-device copies:\n"
                + self.table()
            )
