"""Chapter 7's capture: the whole step, stage by stage.

Parts (``parts``, comma-separated):

* ``waterfall`` -> waterfall.csv: the replayed step stage by stage
  (:func:`waterfall_rows`), before and after chapter 7's stages (:data:`WATERFALL`),
  per precision of the mixing stack, at 512, 4096 and (the default precision, the
  recomputing cohorts) 32,768 atoms.
* ``md`` -> md.csv: MD throughput and energy drift, ASE (eager and replayed) and
  TorchSim, and batches of small systems in TorchSim (:func:`md`).
* ``precision`` -> precision.csv, nve.csv: the whole step's precisions against
  float64, and NVE drift (:func:`precision`).
* ``scale`` -> scale.csv: the replayed step's time and peak memory against the
  number of atoms, per memory strategy, up to the largest box that fits
  (:func:`scale`; run it with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``).
* ``ncu`` -> ncu_kernels.csv: Nsight Compute on the fused geometry and radial
  kernels inside a 4096-atom force step (GPU only).
"""

from __future__ import annotations

import copy
import os
import time

import numpy as np
import torch
from ase import units
from ase.calculators.calculator import Calculator, all_changes
from ase.calculators.mixing import SumCalculator
from ase.md.velocitydistribution import MaxwellBoltzmannDistribution, thermalize_momenta
from ase.md.verlet import VelocityVerlet

from .. import ECEModel, bench, energy_and_forces, options, systems
from ..calculator import ECECalculator
from ..flops import STAGES, stage_costs
from ..graph_step import GraphStep
from ..model import prepare_inputs
from ..train.checks import verlet_energies
from . import common
from .stages import OUTSIDE, profile_stages

__all__ = ["GPU_ONLY", "PARTS", "WATERFALL"]

#: the waterfall's cases: chapter 7's stages as the reference composition and fused
#: (with the packed frames they need: CUDA's default, named for the interpreter)
WATERFALL = {
    "before": dict(geometry="reference", radial="reference"),
    "after": dict(geometry="fused", radial="fused", edge_frame="packed"),
}
#: the mixing stack's precisions, the fp32-accurate default first
PRECISIONS = ("3xtf32", "tf32", "bf16", "fp32")
#: the GEMM ceiling (methodology's ceilings.csv key) each precision's products run at
#: (3xTF32: three TF32 products per product)
RATE = {"fp32": ("gemm_float32", 1), "3xtf32": ("gemm_float32+tf32", 3),
        "tf32": ("gemm_float32+tf32", 1), "bf16": ("gemm_bfloat16", 1)}  # fmt: skip
GAPS, STEP = "(replay minus kernels)", "(replayed step)"
#: the reference's own passes, each counted with the stage chapter 3 folds it into
FOLDED = {"edge_frames": "geometry", "radial_modulation": "rotate_and_select",
          "aggregate": "pack_and_unrotate"}  # fmt: skip


def floor_ms(cost: dict, precision: str, ceil: dict) -> float:
    """A stage's floor (ms): its bytes at the copy bandwidth or its FLOP at the GEMM
    rate of ``precision`` (:data:`RATE`), whichever is longer."""
    key, passes = RATE[precision]
    rate = ceil.get(key, bench.CEILINGS_H200["fp32_TFLOPs"]) / passes
    return bench.floor_ms(cost["bytes"], cost["flop"], ceil["copy_GBps"], rate)


def waterfall_rows(label, precision, model, inputs, dev, ceil, replay_ms) -> list:
    """The waterfall's rows of one case. Per stage of :data:`ecekern.flops.STAGES`
    (the reference's own passes counted with the stage that folds them,
    :data:`FOLDED`): forward and backward kernel time (two eager steps profiled,
    :func:`~.stages.profile_stages`, on the replay's padded graph: its spare edge
    slots cost the stages as in the replay), FLOP and bytes (of the real edges)
    (:func:`ecekern.flops.stage_costs`), its floor at our measured ceilings
    (:func:`~.common.ceilings`, :func:`floor_ms`) and the ratio. Then
    ``(outside the stages)`` (the force step's own kernels: the energy's sum,
    gradient buffers); :data:`GAPS`, the replayed step's time minus every profiled
    kernel's (the gaps between the graph's kernels); :data:`STEP`, the replay."""
    pos, numbers, graph = inputs
    n, E, padded = pos.shape[0], graph.n_edges, GraphStep(model, numbers, graphs=False)
    times = profile_stages(lambda: padded(pos, graph), dev)
    costs = stage_costs(model.config, n, E)
    merged: dict = {}
    for stage, (fwd, bwd) in times.items():  # the reference's own passes, folded
        f0, b0 = merged.get(FOLDED.get(stage, stage), (0.0, 0.0))
        merged[FOLDED.get(stage, stage)] = (f0 + fwd, b0 + bwd)
    rows, kernels = [], 0.0
    for stage in [*(s for s in STAGES if s not in FOLDED), OUTSIDE]:
        fwd, bwd = merged.get(stage, (0.0, 0.0))
        cost = costs.get(stage, {"flop": 0, "bytes": 0})
        floor = floor_ms(cost, precision, ceil)
        kernels += fwd + bwd
        rows.append(dict(stage=stage, forward_ms=fwd, backward_ms=bwd, ms=fwd + bwd,
                         flop=cost["flop"], bytes=cost["bytes"], floor_ms=floor,
                         ratio=(fwd + bwd) / floor if floor > 0 else None))  # fmt: skip
    rows.append(dict(stage=GAPS, ms=replay_ms - kernels))
    total = sum(floor_ms(c, precision, ceil) for c in costs.values())
    rows.append(dict(stage=STEP, ms=replay_ms, floor_ms=total, ratio=replay_ms / total))
    prov = bench.provenance(pos.dtype)
    keys = dict(variant=label, precision=precision, n_atoms=n, n_edges=E)
    return [{**keys, **r, **prov} for r in rows]


def waterfall(run, arg: str = "", cfg=None) -> str:
    """waterfall.csv (module docstring); ``cfg``: the model's config (the book's,
    :func:`~.common.book_config`, by default)."""
    rows: list[dict] = []
    ceil, cuda = common.ceilings(), run.dev == "cuda"
    big = [] if run.quick or not cuda else [16]

    def body(rep, model, inputs):
        precisions = PRECISIONS if rep not in big else PRECISIONS[:1]
        extra = {} if rep not in big else {"memory": "recompute"}
        for precision in precisions if cuda else ("fp32",):
            for label, opts in WATERFALL.items():
                opts = {**opts, **extra}
                if cuda:
                    opts["precision"] = precision
                with options.use(**opts):
                    plan = model.plan(inputs[0].device, inputs[0].dtype).describe()
                    try:
                        step = common.force_row(label, model, inputs, plan, "replay",
                                                **run.timing(300.0, 10))  # fmt: skip
                        rows.extend(waterfall_rows(
                            label, precision, model, inputs, run.dev, ceil, step["ms"]
                        ))  # fmt: skip
                        rows[-1] |= {"plan": plan, "peak_MiB": step["peak_MiB"]}
                    except torch.OutOfMemoryError as exc:
                        rows.append(dict(variant=label, precision=precision,
                                         n_atoms=inputs[0].shape[0], stage=STEP,
                                         error=repr(exc)[:200]))  # fmt: skip
                bench.write_csv(rows, run.out / "waterfall.csv")
                common.free()

    cfg = cfg or common.book_config(run.dev)
    common.for_boxes(run, body, cfg, run.reps() + big, run.dev)
    return "done"


#: MD steps timed at most: the book's model has random weights and no repulsion, so
#: a long run at 300 K can bring two atoms together (the graph refuses them)
MAX_STEPS = 60


def _md_case(advance, total_energy, n_atoms, dev, seconds) -> dict:
    """Time ``advance(k)`` (k MD steps) after three warm-up steps, for ``seconds``
    or :data:`MAX_STEPS` steps, whichever comes first, and at least 5; the total
    energy before and after."""
    advance(3)  # the capture, the first compiles
    common.sync(dev)
    e0, steps = total_energy(), 0
    t0 = time.perf_counter()
    while steps < 5 or (time.perf_counter() - t0 < seconds and steps < MAX_STEPS):
        advance(5)
        steps += 5
    common.sync(dev)
    dt = time.perf_counter() - t0
    drift = (total_energy() - e0) / n_atoms / (steps * 1e-3)  # eV/atom/ps at 1 fs
    per_s = steps / dt
    return dict(steps=steps, ms_per_step=1e3 / per_s, steps_per_s=per_s,
                ns_per_day=per_s * 86400 * 1e-6, atom_steps_per_s=per_s * n_atoms,
                drift_meV_atom_ps=drift * 1e3)  # fmt: skip


def md(run, arg: str = "", cfg=None) -> str:
    """md.csv: NVE molecular dynamics at 1 fs from 300 K, the book's model in
    float32 with the library's plan: ASE's Velocity Verlet through
    :class:`~ecekern.ECECalculator` (eager, ``graph_step=False``, and replayed, its
    CUDA default) and TorchSim's (:class:`~ecekern.torchsim.ECETorchSimModel`), at
    512, 4096 and 32,768 atoms; then batches of 64-atom systems in one TorchSim
    state. Per case: ms per MD step, steps per second, ns/day, atom-steps per second
    and the total energy's drift (meV/atom/ps) over the timed steps; a case out of
    memory, or whose atoms met, is a row with its error."""
    rows: list[dict] = []
    cfg, cuda = cfg or common.book_config(run.dev), run.dev == "cuda"
    seconds = 2.0 if cuda else 0.0
    prov = bench.provenance(torch.float32)
    model = ECEModel(cfg).to(device=run.dev, dtype=torch.float32)

    def add(host, n_systems, atoms_each, case):
        row = dict(host=host, n_systems=n_systems, n_atoms=atoms_each)
        try:
            row |= case()
            print("md", host, n_systems, atoms_each,
                  f"{row['ms_per_step']:.2f} ms", flush=True)  # fmt: skip
        except (torch.OutOfMemoryError, ValueError) as exc:  # memory; atoms met
            row["error"] = repr(exc)[:200]
        rows.append({**row, **prov})
        bench.write_csv(rows, run.out / "md.csv")
        common.free()

    def ase(rep, graph_step):
        atoms = systems.diamond(rep, seed=1)
        MaxwellBoltzmannDistribution(atoms, temperature_K=300,
                                     rng=np.random.default_rng(0))  # fmt: skip
        atoms.calc = ECECalculator(model, graph_step=graph_step)
        dyn = VelocityVerlet(atoms, timestep=1.0 * units.fs)
        return _md_case(dyn.run, atoms.get_total_energy, len(atoms), run.dev, seconds)

    def torchsim(reps):
        return lambda: _torchsim_case(model, reps, run.dev, seconds)

    for rep in run.reps() + ([] if run.quick or not cuda else [16]):
        add("ASE eager", 1, 8 * rep**3, lambda: ase(rep, False))
        if cuda:
            add("ASE replayed", 1, 8 * rep**3, lambda: ase(rep, None))
        add("TorchSim", 1, 8 * rep**3, torchsim([rep]))
    for n_systems in (1, 8, 32) if cuda else (2,):
        add("TorchSim", n_systems, 64, torchsim([2] * n_systems))
    return "done"


def _torchsim_case(model, reps, dev, seconds) -> dict:
    """:func:`_md_case` of TorchSim's NVE over one state of diamond boxes."""
    import torch_sim as ts

    from ..torchsim import ECETorchSimModel

    boxes = [systems.diamond(r, seed=1 + i) for i, r in enumerate(reps)]
    state = ts.io.atoms_to_state(boxes, torch.device(dev), torch.float32)
    sim = ECETorchSimModel(model, compute_stress=False)
    u = ts.units.MetalUnits
    kT = torch.tensor(300 * u.temperature, dtype=torch.float32, device=dev)
    dt = torch.tensor(1e-3 * u.time, dtype=torch.float32, device=dev)  # 1 fs
    init, step = ts.nve(sim, dt=dt, kT=kT, seed=0)
    md = [init(state)]

    def advance(k):
        for _ in range(k):
            md[0] = step(md[0], dt=dt)

    def total():
        s = md[0]
        kinetic = ts.calc_kinetic_energy(masses=s.masses, momenta=s.momenta)
        return float(s.energy.sum() + kinetic)

    return _md_case(advance, total, sum(len(b) for b in boxes), dev, seconds)


#: The whole-step precision study's cases: (label, TF32, options) on top of chapter
#: 7's fused stages; the library's default step (the 3xTF32 layer kernels) first;
#: fp64 (the same weights) is the truth
STEP_PRECISIONS = (
    ("3xTF32 layers (default)", False, {}),
    ("strict fp32 layers", False, {"stack": "layers", "precision": "fp32"}),
    ("TF32 layers", False, {"stack": "layers", "precision": "tf32"}),
    ("bf16 layers", False, {"stack": "layers", "precision": "bf16"}),
    ("3xTF32 fused, recompute", False,
     {"stack": "fused", "precision": "3xtf32", "memory": "recompute"}),
    ("TF32 everywhere", True, {"stack": "layers", "precision": "tf32"}),
)  # fmt: skip
#: rattles (A) of the force comparison; NVE: time step and length (fs), temperature
#: (K) and the spring (eV/A^2) tethering each atom to its start (the random model has
#: no repulsion: untethered atoms meet within a picosecond)
RATTLES, NVE_DT_FS, NVE_FS, NVE_K, TETHER = (0.05, 0.25), 1.0, 1000.0, 300.0, 1.0


def _tethered(model, anchor):
    """The model's ASE calculator (replayed on CUDA) plus ``sum_i TETHER |x_i -
    anchor_i|^2 / 2`` in float64: exact and conservative, so any drift is the
    model's."""

    class Tether(Calculator):
        implemented_properties = ["energy", "free_energy", "forces"]

        def calculate(self, atoms=None, properties=("energy",),
                      system_changes=all_changes):  # fmt: skip
            super().calculate(atoms, properties, system_changes)
            d = self.atoms.positions - anchor
            e = 0.5 * TETHER * float(np.sum(d * d))
            self.results = {"energy": e, "free_energy": e, "forces": -TETHER * d}

    return SumCalculator([ECECalculator(model), Tether()])


def _nve_drift(atoms, length: float) -> dict:
    """Velocity Verlet at :data:`NVE_DT_FS` for ``length`` fs from ``atoms`` (their
    calculator and momenta set): the total energy's drift per atom (a linear fit,
    meV/atom/ps) and its largest deviation (meV/atom), after every step."""
    t, de = verlet_energies(atoms, NVE_DT_FS, round(length / NVE_DT_FS))
    return dict(drift_meV_per_atom_ps=1e3 * np.polyfit(t, de, 1)[0],
                max_dev_meV_per_atom=1e3 * np.abs(de).max())  # fmt: skip


def precision(run, arg: str = "", cfg=None) -> str:
    """precision.csv and nve.csv: the whole step in each precision of
    :data:`STEP_PRECISIONS` (chapter 7's fused stages on) against float64 with the
    same weights at 512 atoms (force errors relative to the force RMS, energy per
    atom), and the total energy's drift in NVE (1 fs, 1 ps from 300 K, tethered,
    ASE's Velocity Verlet through the replayed calculator, :func:`_nve_drift`)."""
    cuda = run.dev == "cuda"
    cfg = cfg or common.book_config(run.dev)
    rep, length = (4, NVE_FS) if cuda else (1, 5 * NVE_DT_FS)
    torch.manual_seed(0)
    m64 = ECEModel(cfg).double().to(run.dev)
    m32 = copy.deepcopy(m64).float()
    cases = [("fp64", m64, False, {})]
    for label, tf32, opts in STEP_PRECISIONS if cuda else STEP_PRECISIONS[:1]:
        cases.append((label, m32, tf32, {**WATERFALL["after"], **opts}))
    rows, nve = [], []
    for rattle in RATTLES:
        atoms = systems.diamond(rep, rattle=rattle, seed=0)
        e_ref, f_ref = (t.detach().cpu().double()
                        for t in energy_and_forces(m64, atoms))  # fmt: skip
        f_rms = f_ref.square().mean().sqrt().item()
        for label, model, tf32, opts in cases[1:]:
            with common.switched(opts, tf32):
                got = energy_and_forces(model, atoms)
            e, f = (t.detach().cpu().double() for t in got)
            d = (f - f_ref).norm(dim=1)
            rows.append(dict(precision=label, rattle_A=rattle, n_atoms=len(atoms),
                             force_rms_eV_A=f_rms,
                             max_force_err_rel=d.max().item() / f_rms,
                             rms_force_err_rel=d.square().mean().sqrt().item() / f_rms,
                             energy_err_per_atom_eV=abs(e - e_ref).item() / len(atoms),
                             **bench.provenance(torch.float32)))  # fmt: skip
            bench.write_csv(rows, run.out / "precision.csv")
    for label, model, tf32, opts in cases:
        atoms = systems.diamond(rep, rattle=RATTLES[0], seed=0)
        thermalize_momenta(atoms, NVE_K, rng=np.random.default_rng(0))
        atoms.calc = _tethered(model, atoms.positions.copy())
        try:
            with common.switched(opts, tf32):
                row = _nve_drift(atoms, length)
        except (ValueError, torch.OutOfMemoryError) as exc:  # a row, not the end
            row = {"error": repr(exc)[:300]}
        prov = bench.provenance(next(model.parameters()).dtype)
        nve.append(dict(precision=label, n_atoms=len(atoms), dt_fs=NVE_DT_FS,
                        length_fs=length, temperature_K=NVE_K, tether_eV_A2=TETHER,
                        **row, **prov))  # fmt: skip
        bench.write_csv(nve, run.out / "nve.csv")
        common.free()
    return "done"


#: the scale part's memory strategies (chapter 6) and diamond repeats, in order
SCALE_MEMORY = ("keep", "recompute")
SCALE_REPS = (4, 6, 8, 10, 12, 14, 16, 18, 20, 22)


def scale(run, arg: str = "", cfg=None) -> str:
    """scale.csv: the replayed force step (chapter 7's stages on, the default
    precision) against the number of atoms, per memory strategy of
    :data:`SCALE_MEMORY`, from 512 atoms up to the first box that does not fit (its
    row says so): time, time per atom-step and peak memory. The allocator's setting
    (``PYTORCH_CUDA_ALLOC_CONF``, e.g. ``expandable_segments:True``, read when CUDA
    starts) is each row's ``alloc_conf``."""
    cfg = cfg or common.book_config(run.dev)
    reps = SCALE_REPS if run.dev == "cuda" and not run.quick else (1,)
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    rows: list[dict] = []
    model = ECEModel(cfg).to(device=run.dev, dtype=torch.float32)
    for memory in SCALE_MEMORY:
        for rep in reps:
            atoms = systems.diamond(rep)
            opts = {**WATERFALL["after"], "memory": memory}
            try:
                inputs = prepare_inputs(atoms, cfg.cutoff, torch.float32, run.dev)
                with options.use(**opts):
                    label, timing = f"memory={memory}", run.timing(200.0, 5)
                    row = common.force_row(label, model, inputs, "", "replay", **timing)
                row["us_per_atom_step"] = 1e3 * row["ms"] / len(atoms)
            except torch.OutOfMemoryError as exc:
                row = dict(system=f"memory={memory}", n_atoms=len(atoms),
                           mode="replay", error=repr(exc)[:200])  # fmt: skip
            rows.append({**row, "memory": memory, "alloc_conf": conf})
            bench.write_csv(rows, run.out / "scale.csv")
            inputs = None
            common.free()
            if "error" in row:
                break
    return "done"


#: Nsight Compute on chapter 7's kernels inside a 4096-atom force step
#: (:func:`ecekern.captures.targets.step_kernels`)
_ncu = common.ncu_part(
    {"kernels": ("step_kernels", ["-k", "regex:_geometry|_radial|_atoms_kernel"])}
)
PARTS = {"waterfall": waterfall, "md": md, "precision": precision,
         "scale": scale, "ncu": _ncu}  # fmt: skip
GPU_ONLY = ("ncu",)
