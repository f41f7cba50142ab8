"""Chapter 6's capture: the mixing stack's backward in cohorts, against the plain stack.

Parts (``parts``, comma-separated), on the book's model (L = 2, C = 32), strict fp32,
every earlier chapter's fast path on (the library's defaults):

* ``stack`` -> stack.csv: the mixing stack alone (one layer's, forward + input
  backward) at the 512- and 4096-atom boxes' edge counts, plain and in cohorts of
  several sizes: time (ms) and the peak memory above the inputs (MiB);
* ``steps`` -> steps.csv: the force step at 512 and 4096 atoms with the ``cohorts``
  option off and on: time and peak memory (the step-level target: at most 5 % slower);
* ``memory`` -> memory.csv: the force step's peak memory against the atom count, off
  and on, up to the boxes given (``memory=4,6,8``: diamond repeats), and the largest
  box that ran (an out-of-memory is a row, not the end of the run).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .. import bench, options
from .common import book_config, device, free, parse_parts, run_parts

__all__ = ["capture"]

PARTS = ("stack", "steps", "memory")
#: Cohort sizes the ``stack`` part compares (None: the plain stack).
COHORTS = (None, 2048, 8192, 32768)


def capture(
    out: Path,
    quick: bool = False,
    ncu: bool = True,
    parts: str = "stack,steps,memory",
    boxes: str | None = None,
) -> dict:
    """Chapter 6 (module docstring). On a CPU, ``stack`` runs at a tiny size as a
    smoke test; ``steps`` and ``memory`` need a GPU."""
    todo = parse_parts(parts, PARTS)
    dev = device()
    info: dict = {"parts": sorted(todo)}
    reps = [1] if dev != "cuda" else ([4] if quick else [4, 8])
    boxes_ = [int(b) for b in (todo.get("memory") or "4,8,12,16").split(",")]
    parts_ = (
        ("stack", lambda: _stack(out, reps, dev)),
        ("steps", lambda: _steps(out, reps)),
        ("memory", lambda: _memory(out, boxes_[:2] if quick else boxes_)),
    )
    run_parts(parts_, todo, info, dev, gpu_only=("steps", "memory"))
    return info


def _stack(out: Path, reps: list[int], dev: str) -> str:
    import ecekern
    from ecekern import cohorts, reference
    from ecekern.linear import equivariant_linear
    from ecekern.model import prepare_inputs

    cfg = book_config(dev, n_gated=2)
    model = ecekern.ECEModel(cfg).to(dev)
    layer = model.interactions[0]
    weights = [lin.weight for lin in layer.gated]
    biases = [lin.bias for lin in layer.gated]
    rows = []
    for rep in reps:
        *_, graph = prepare_inputs(
            ecekern.systems.diamond(rep), cfg.cutoff, torch.float32, dev
        )
        E = graph.n_edges
        x = [
            torch.randn(E, cfg.F, cfg.n_ang, device=dev, requires_grad=True)
            for _ in range(2)
        ]
        gy = [torch.randn(E, layer.out.weight.shape[1], cfg.n_ang, device=dev)]
        gy.append(torch.randn_like(gy[0]))
        for cohort in COHORTS:

            def run(cohort=cohort):
                if cohort is None:
                    y = reference.mixing_stack(
                        *x, weights, biases, layer.out.weight, layer.out.bias,
                        equivariant_linear,
                    )  # fmt: skip
                else:
                    y = cohorts.mixing_stack(
                        *x, weights, biases, layer.out.weight, layer.out.bias,
                        equivariant_linear, cohort_edges=cohort,
                    )  # fmt: skip
                return torch.autograd.grad(y, x, gy)

            t = bench.time_fn(run) if dev == "cuda" else None
            rows.append(
                {
                    "stack": "plain" if cohort is None else "cohorts",
                    "cohort_edges": cohort or "",
                    "n_edges": E,
                    "fwd_bwd_ms": t.median if t else float("nan"),
                    "fwd_bwd_p10_ms": t.p10 if t else float("nan"),
                    "fwd_bwd_p90_ms": t.p90 if t else float("nan"),
                    "peak_MiB": bench.peak_memory(run) / 2**20,
                    **bench.provenance(torch.float32),
                }
            )
            print(f"stack {rows[-1]['stack']} {cohort} E={E}: "
                  f"{rows[-1]['fwd_bwd_ms']:.2f} ms", flush=True)  # fmt: skip
            bench.write_csv(rows, out / "stack.csv")
            free()
    return "done"


def _steps(out: Path, reps: list[int]) -> str:
    import ecekern
    from ecekern.model import force_step, prepare_inputs

    cfg = book_config("cuda", n_gated=2)
    rows = []
    for rep in reps:
        inputs = prepare_inputs(
            ecekern.systems.diamond(rep), cfg.cutoff, torch.float32, "cuda"
        )
        model = ecekern.ECEModel(cfg).to("cuda")
        for on in (False, True):
            with options.use(cohorts=on) as now:
                fn = lambda: force_step(model, *inputs)
                fn()
                t = bench.time_fn(fn, min_reps=10)
                rows.append(
                    {
                        "cohorts": on,
                        "n_atoms": inputs[0].shape[0],
                        "n_edges": inputs[2].n_edges,
                        "step_ms": t.median,
                        "step_p10_ms": t.p10,
                        "step_p90_ms": t.p90,
                        "peak_mem_MiB": bench.peak_memory(fn) / 2**20,
                        "options_repr": repr(now),
                        **bench.provenance(torch.float32),
                    }
                )
            print(f"steps cohorts={on} {rows[-1]['n_atoms']}: "
                  f"{rows[-1]['step_ms']:.1f} ms", flush=True)  # fmt: skip
            bench.write_csv(rows, out / "steps.csv")
            free()
        model = inputs = None
        free()
    return "done"


def _memory(out: Path, boxes: list[int]) -> dict:
    import ecekern
    from ecekern.model import force_step, prepare_inputs

    cfg = book_config("cuda", n_gated=2)
    model = ecekern.ECEModel(cfg).to("cuda")
    rows, largest = [], {}
    for on in (False, True):
        for rep in boxes:
            row = {"cohorts": on, "repeats": rep}
            try:
                inputs = prepare_inputs(
                    ecekern.systems.diamond(rep), cfg.cutoff, torch.float32, "cuda"
                )
                row |= {"n_atoms": inputs[0].shape[0], "n_edges": inputs[2].n_edges}
                with options.use(cohorts=on):
                    peak = bench.peak_memory(lambda: force_step(model, *inputs))
                row["peak_mem_MiB"] = peak / 2**20
                largest[str(on)] = row["n_atoms"]
            except torch.cuda.OutOfMemoryError:
                row["peak_mem_MiB"] = "out of memory"
            inputs = None
            free()
            rows.append({**row, **bench.provenance(torch.float32)})
            print(f"memory cohorts={on} repeats={rep}: {row['peak_mem_MiB']}",
                  flush=True)  # fmt: skip
            bench.write_csv(rows, out / "memory.csv")
            if row["peak_mem_MiB"] == "out of memory":
                break
    return {"largest box (atoms), cohorts off / on": largest}
