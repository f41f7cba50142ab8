"""Forward and backward time by stage of the model, from one ``torch.profiler`` run.

The model runs each stage inside ``record_function("ece::<stage>")``, so the forward's
time by stage is the kernel time inside those ranges. The backward has no ranges: its
autograd nodes run later, on the engine's thread. Each is linked back to the forward
op that made it by the profiler's sequence numbers: a forward op records the sequence
number its autograd node will get (``sequence_nr``), and the engine's
``autograd::engine::evaluate_function: <Node>`` event records the node's. So a
backward event's time goes to the stage whose range held the forward op that made
its node. What no range holds (the energy's sum, ``force_step``'s own ops) is the
``(outside the stages)`` row.

Which op made node n: several ops can record n (a composite op and the ops inside
it, and every op after the last node until the next one is made); the one that made
it is the last of them to start (the ops that start after it record n + 1).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable

import torch

from .. import bench

__all__ = ["OUTSIDE", "profile_stages", "stage_rows", "stage_times"]

PREFIX = "ece::"
BACKWARD = "autograd::engine::evaluate_function: "
OUTSIDE = "(outside the stages)"


def device_us(e) -> float:
    """The kernel time (us) of a CPU event and everything under it."""
    t = getattr(e, "device_time_total", None)
    return float(e.cuda_time_total if t is None else t)


def cpu_us(e) -> float:
    """The CPU time (us) of an event and everything under it (a CPU-only profile)."""
    return float(e.cpu_time_total)


def _is_cpu(e) -> bool:
    return str(getattr(e, "device_type", "CPU")).split(".")[-1] == "CPU"


def _ancestors(e):
    p = e.cpu_parent
    while p is not None:
        yield p
        p = p.cpu_parent


def stage_times(events: Iterable, time_us: Callable = device_us,
                iters: int = 1) -> dict[str, tuple[float, float]]:  # fmt: skip
    """``{stage: (forward_ms, backward_ms)}`` per call from a profile of ``iters``
    calls (``prof.events()``); ``time_us(event)`` is the time counted for an event
    and its children (kernel time by default). Stages in the order they first ran,
    then :data:`OUTSIDE`."""
    events = [e for e in events if _is_cpu(e)]
    fwd: dict[str, float] = defaultdict(float)
    bwd: dict[str, float] = defaultdict(float)
    order: dict[str, None] = {}
    made_by: dict[tuple, tuple[float, str]] = {}  # (thread, seq) -> (start, stage)
    forward_total = 0.0
    backward_events = []
    for e in events:
        name = e.name
        up = list(_ancestors(e))
        if name.startswith(BACKWARD):
            if not any(a.name.startswith(BACKWARD) for a in up):
                backward_events.append(e)
            continue
        if any(a.name.startswith(BACKWARD) for a in up):
            continue  # inside a backward node
        if not up:
            forward_total += time_us(e)  # a top-level event: its time counts once
        if name.startswith(PREFIX):
            stage = name[len(PREFIX) :]
            order.setdefault(stage, None)
            if not any(a.name.startswith(PREFIX) for a in up):
                fwd[stage] += time_us(e)
        if e.sequence_nr is not None and e.sequence_nr >= 0:
            ranges = [a for a in up if a.name.startswith(PREFIX)]
            stage = ranges[-1].name[len(PREFIX) :] if ranges else OUTSIDE
            key = (e.thread, e.sequence_nr)
            start = e.time_range.start
            if key not in made_by or start >= made_by[key][0]:
                made_by[key] = (start, stage)
    for e in backward_events:
        seq = e.sequence_nr
        if seq is None or seq < 0:  # the node's own event carries it
            seq = next(
                (c.sequence_nr for c in e.cpu_children if c.sequence_nr >= 0), -1
            )
        thread = getattr(e, "fwd_thread", None) or next(
            (c.fwd_thread for c in e.cpu_children if c.fwd_thread), 0
        )
        stage = made_by.get((thread, seq), (0.0, None))[1]
        if stage is None:  # no forward thread recorded: match the number alone
            stage = next((s for (t, n), (_, s) in made_by.items() if n == seq), OUTSIDE)
        bwd[stage] += time_us(e)
    top_ranges = sum(fwd.values())
    fwd[OUTSIDE] += max(forward_total - top_ranges, 0.0)
    stages = [*order, OUTSIDE]
    return {s: (fwd[s] / 1e3 / iters, bwd[s] / 1e3 / iters) for s in stages}


def profile_stages(step, dev: str, iters: int = 2) -> dict[str, tuple[float, float]]:
    """:func:`stage_times` per call of ``step``, ``iters`` calls profiled
    (:func:`~.common.profiled`): kernel time on a GPU, CPU time without one."""
    from .common import profiled

    events = profiled(step, iters, dev)[0].events()
    return stage_times(events, device_us if dev == "cuda" else cpu_us, iters)


def stage_rows(label: str, step, n_atoms: int, dev: str) -> list[dict]:
    """Rows of a stages.csv: one force step's forward and backward time by stage
    (:func:`profile_stages`), with the provenance of a float32 run."""
    prov = bench.provenance(torch.float32)
    return [{"system": label, "n_atoms": n_atoms, "stage": stage, "forward_ms": f,
             "backward_ms": b, **prov}
            for stage, (f, b) in profile_stages(step, dev).items()]  # fmt: skip
