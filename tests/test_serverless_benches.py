"""The multi-seed and regime studies of MoEless (engine/bench/bench_serverless_{seeds,regimes}.py): structure
on a tiny replay (two seeds of a 2-s trace slice), not their numbers."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest

import engine.serve as serve

from engine.bench import bench_serverless_regimes as regimes
from engine.bench import bench_serverless_seeds as seeds

TINY = ["workload.azure.max_context_tokens=48", "workload.azure.max_generated_tokens=12", "decode_stride=8"]


ORACLE_SEEDS: list[int] = []  # the seed each run's oracle predictor got


@pytest.fixture(scope="module")
def rows():
    real = serve.load_predictor

    def spy(cfg, **kwargs):
        ORACLE_SEEDS.append(cfg.seed)
        return real(cfg, **kwargs)

    jobs = seeds.seed_jobs(["mixtral_8x7b"], [0, 1], duration_s=1.0, extra=TINY, out=None)
    with mock.patch.object(serve, "load_predictor", spy):
        return [{**seeds.simulate(overrides), **tags} for overrides, _, tags in jobs]


def test_seed_study_tables_every_system_with_std_across_seeds(rows):
    summary = seeds.aggregate(rows)
    block = summary["mixtral-8x7b"]
    assert block["seeds"] == [0, 1]
    assert list(block["systems"]) == list(seeds.SYSTEMS)
    for kind, stats in block["systems"].items():
        assert set(stats) == set(seeds.METRICS)
        for metric, (mean, std) in stats.items():  # mean and sample std over the two seeds' runs
            values = [r["systems"][kind][metric] for r in rows]
            assert mean == pytest.approx(np.mean(values)) and std == pytest.approx(np.std(values, ddof=1)), (kind, metric)
    assert block["systems"]["moeless"]["latency_ms"][1] > 0  # the seeds really differ
    assert set(block["moeless_vs"]) == {"static_ep", "eplb", "oracle"}
    rel = [r["systems"]["moeless"]["latency_ms"] / r["systems"]["eplb"]["latency_ms"] - 1 for r in rows]
    assert block["moeless_vs"]["eplb"]["latency_ms"] == pytest.approx((np.mean(rel), np.std(rel, ddof=1)))
    text = seeds.markdown(summary)
    for name in seeds.NAMES.values():
        assert f"| {name} |" in text
    assert "±" in text and "MoEless vs" in text


def test_seeds_change_the_routing_and_the_synthetic_model(rows):
    assert [r["overrides"][1:3] for r in rows] == [["seed=0", "routing.model_seed=0"], ["seed=1", "routing.model_seed=1"]]
    a, b = (r["routing_statistics"] for r in rows)
    assert a["cv_mean"] != b["cv_mean"]  # different traffic and hot experts, not the same trace twice
    assert ORACLE_SEEDS == [0, 1]  # the run's seed reaches the oracle forecasts' errors too


def test_regime_points_share_the_default_run_and_compare_moeless_with_eplb():
    def row(axis, value, seed, moeless, eplb):
        systems = {kind: {"latency_ms": ms, "exec_ms": ms / 2, "warm_start_rate": 0.5, "misc_ms": 4.0}
                   for kind, ms in (("moeless", moeless), ("eplb", eplb), ("static_ep", 1.0))}
        return {"axis": axis, "value": value, "seed": seed, "systems": systems, "cost_model": {"peer_copy_ms": 5.0},
                "eplb_rearrangements_per_layer": 3.0}

    names = regimes.regimes(["skew", "copy_speed_varied"])
    assert [axis for axis, _ in names.values()] == ["default"] + ["skew"] * 2 + ["copy_speed_varied"] * len(regimes.AXES["copy_speed_varied"][1])
    rows = [row("default", 0.0, s, 2.0 + s, 1.0) for s in (0, 1)] + [row("skew", 0.6, s, 0.5, 1.0) for s in (0, 1)]
    pts = regimes.points(regimes.with_defaults(rows, ["skew"]))
    assert [(p["axis"], p["value"]) for p in pts] == [("skew", 0.2), ("skew", 0.6)]  # the default is skew's first point
    assert pts[0]["vs_eplb"] == pytest.approx((1.5, np.std([1.0, 2.0], ddof=1)))
    assert pts[1]["vs_eplb"] == (pytest.approx(-0.5), 0.0) and pts[1]["copy_layer_times"][0] == pytest.approx(5.0)
    assert pts[1]["copy_block_times"][0] == pytest.approx(1.0)  # 5 ms over Megatron-LM's 1 ms MoE + 4 ms attention
    assert "| skew | 0.6 |" in regimes.markdown(pts)


def _frontier_results(seed: int, eplb_ms: float, predictor: dict) -> dict:
    """A frontier job's results.json as engine.serve writes it (the keys the report reads)."""
    def system(kind: str, ms: float, gib: float) -> dict:
        return {"kind": kind, "mean_moe_ms": ms, "mean_moe_exec_ms": ms, "held_memory_time_avg_gib": gib,
                "copies": 0.0, "warm_start_rate": 1.0}

    moeless = 0.5 if predictor.get("upper_bound") else 0.8  # the trained predictor's MoEless is slower here
    return {"mode": "simulate", "model": "m", "routing": "domains", "hardware": "a6000", "iterations": 10.0,
            "workload": {"duration_s": 1.0}, "predictor": predictor,
            "experiments": {"frontier": {"systems": {"Megatron-LM": system("static_ep", 1.0 + seed, 84.0),
                                                     "EPLB 3000/1000": system("eplb", eplb_ms, 168.0),
                                                     "MoEless strong": system("moeless", moeless, 90.0)}}}}


def test_frontier_report_from_multirun_jobs(tmp_path):
    """engine.report on a folder of frontier jobs: a table per (model, routing) with mean ± std over the seeds,
    per-seed paired changes, and MoEless once per forecast source (its trained predictor beside the oracle)."""
    import json

    from engine import report
    from engine.bench.bench_serverless_frontier import multirun_command

    oracle = {"name": "oracle", "upper_bound": True, "hit_rate_by_distance": {"1": 0.9}}
    trained = {"name": "moeless_mixtral_tiny", "hit_rate_by_distance": {"1": 0.906}}
    for job, (seed, eplb, pred) in enumerate([(0, 2.0, oracle), (1, 4.0, oracle), (0, 2.0, trained), (1, 4.0, trained)]):
        folder = tmp_path / str(job)
        (folder / ".hydra").mkdir(parents=True)
        (folder / ".hydra" / "config.yaml").write_text(f"seed: {seed}\n")
        (folder / "results.json").write_text(json.dumps(_frontier_results(seed, eplb, pred)))
    path = report.build(tmp_path)
    text = path.read_text()
    assert "| Megatron-LM | 2 | 1.5 ± 0.71 |" in text  # mean ± sample std over seeds 0 and 1
    assert "-50.0 % ± 0.0" in text  # Megatron-LM against EPLB 3000/1000, paired per seed: 1/2 and 2/4
    assert text.count("| Megatron-LM |") == 1  # systems that ignore forecasts: once
    assert "| MoEless strong [moeless_mixtral_tiny (trained, hit rate 0.906)] | 2 | 0.8 ± 0 |" in text
    assert "| MoEless strong [oracle, hit rate 0.900, upper bound] | 2 | 0.5 ± 0 |" in text
    assert (tmp_path / "m_domains.png").is_file()
    cmd = multirun_command("m", "0,1", 10.0, 2, tmp_path)
    assert "+experiment=serverless_frontier" in cmd and "hydra.launcher.n_jobs=2" in cmd
