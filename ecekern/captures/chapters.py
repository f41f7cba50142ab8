"""What each chapter's capture measures, by the chapter's slug: one module each.

Each entry is ``capture(out, quick=False, ncu=True, parts=..., boxes=None) -> info``:
it writes the chapter's files into ``out`` and returns what the manifest should say
besides (what failed or was skipped, the launches chosen). Runs on a CUDA GPU; the
launch sweeps and sweeps of chapters 2 and 5 also run on a CPU, at tiny sizes in
Triton's interpreter, as a smoke test.
"""

from __future__ import annotations

from . import cohorts, edge_frame, graph_step, linear, methodology, reference, zonal

REGISTRY = {
    "methodology": methodology.capture,
    "01_reference": reference.capture,
    "02_linear": linear.capture,
    "03_edge_frame": edge_frame.capture,
    "04_graph_step": graph_step.capture,
    "05_zonal": zonal.capture,
    "06_cohorts": cohorts.capture,
}
