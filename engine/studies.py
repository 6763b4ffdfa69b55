"""The jobs of moescope's studies as Hydra multiruns (`conf/experiment/<study>.yaml`).

A study is `python -m engine.simulate +experiment=<study> -m` (any Hydra launcher: joblib by default, submitit,
Ray): the experiment config sweeps the axes that need their own routing (model x batch x seed, or the PreSched
regime x seed), and each job replays its routing under every system and machine (`study.kind`), since a routing
costs more than most replays. A job writes its rows into its folder's results.json (`study_rows`), which
`python -m engine.report <multirun folder>` reads back, whichever launcher ran the jobs.

    kind             one job                                      experiment configs
    systems          one (model, batch, seed): study.systems x study.machines   fig11, fig13_ablation, fig11_seeds
    hit_rates        one (model, batch, seed): PreSched at each forecast point   hit_rate_sweep
    presched_regime  one (regime, seed): PreSched vs layerwise with each forecast presched_regimes
    horizon          one (point, seed): every offload policy, the lower bounds    horizon_study, horizon_regimes,
                                                                                  horizon_replay

An `engine.serve` study job is an engine.serve run as any other: `serverless_seeds` sweeps its keys directly, and
`serverless_regimes` moves one knob at a time by naming the regime (`study.regime`), which `serve_study_node`
applies to the composed config before the job runs (so wandb and results.json see the knob's value).
"""

from __future__ import annotations

import copy
import time
from typing import Any

from omegaconf import DictConfig

STUDY_KINDS = ("systems", "hit_rates", "presched_regime", "horizon")


def study_rows(cfg: DictConfig) -> list[dict[str, Any]]:
    """The rows of one study job: every replay its `study` node asks for (see the module docstring)."""
    from engine.bench import bench_presched_regimes as regimes  # the studies' own code: loaded by their jobs
    from engine.bench import bench_simulate_sweep as sweep
    from engine.simulate import spec_from_config

    study = cfg.study
    kind = str(study.kind)
    if kind == "presched_regime":
        if not study.regime:
            raise ValueError("study.regime: a presched_regime job needs the regime's name")
        from models.loading import expert_format

        return regimes.run_regime((regimes.regime_named(str(study.regime)), int(cfg.seed), expert_format(cfg.model)))
    if kind == "horizon":
        from engine.bench import bench_horizon_study as horizon

        return horizon.job_rows(cfg)
    if kind not in STUDY_KINDS:
        raise ValueError(f"study.kind: {kind!r} is not a study job; known: {', '.join(STUDY_KINDS)}")
    base = spec_from_config(cfg)
    machines = [str(m) for m in study.machines] or [base.hardware.name]
    if kind == "hit_rates":
        points = [str(p) for p in study.hit_rates]
        if not points:
            raise ValueError("study.hit_rates: a hit_rates job needs its points, e.g. [0.5,measured,1.0]")
        for point in points:
            sweep.sweep_predictor(point)  # a bad point fails before any replay
        return sweep.hit_rows(base, points, machines, base.routing.name)
    systems = [str(s) for s in study.systems]
    if not systems:
        raise ValueError("study.systems: a systems job needs the conf/scheduler names it replays")
    return sweep.group_rows(base, systems, machines, base.routing.name, bool(cfg.bounds.lower_bound))


def study_job(cfg: DictConfig) -> dict[str, Any]:
    """One study job's results: its rows, what it was and what it took (wall and CPU seconds)."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    rows = study_rows(cfg)
    return {"study": str(cfg.study.kind), "regime": cfg.study.regime, "seed": int(cfg.seed), "runs": len(rows),
            "job_wall_s": time.perf_counter() - wall0, "job_cpu_s": time.process_time() - cpu0,
            "study_rows": rows}


def serve_study_node(node: DictConfig) -> DictConfig:
    """An `engine.serve` job's config with its serverless regime applied (`study.regime`: one knob of
    engine.bench.bench_serverless_regimes moved); the node itself when it names none."""
    name = node.get("study", {}).get("regime")
    if not name:
        return node
    from omegaconf import OmegaConf

    from engine.bench.bench_serverless_regimes import regime_settings

    settings = regime_settings(str(name), node)
    out = copy.deepcopy(node)
    for key, value in settings.items():
        OmegaConf.update(out, key, value, merge=False)
    return out


def serve_study_tags(node: DictConfig) -> dict[str, Any]:
    """What a serve study job was, for its results.json (`study`): the regime, its axis and value; empty when
    the job is no study point."""
    name = node.get("study", {}).get("regime")
    if not name:
        return {}
    from engine.bench.bench_serverless_regimes import regime_named

    axis, value = regime_named(str(name))
    return {"study": {"regime": str(name), "axis": axis, "value": value}}
