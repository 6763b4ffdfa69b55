"""The oracle as a labelled upper bound at a measured hit rate (issue 20, item 2): the simulator's default oracle
reads LLaPor's hit rates measured on moescope's own mixtral-tiny (engine/data/measured_hit_rates.yaml) per
distance, results name that source, and the hit-rate sweep reports PreSched against the oracle's hit rate with
the measured point and the real predictors in it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from conf import compose
from engine.bench.bench_simulate_sweep import run_hit_sweep
from engine.report import write_report
from engine.sim.measured import measured_hit_rates, oracle_default, realistic_d1
from engine.sim.run import default_predictor, prepare_routing, simulate
from engine.simulate import predictor_results, spec_from_config
from predictors.config import OracleSpec, PredictorKind, oracle_config, predictor_config
from predictors.factory import make_predictors

SMALL = ["model=mixtral_8x7b", "batch_size=4", "prompt_len=8", "gen_len=4", "hot_table.profile_sequences=8"]


def llapor_measured() -> list[float]:
    by_d = measured_hit_rates()["llapor"][measured_hit_rates()["oracle_default"]["model"]]["hit_rate"]
    return [float(by_d[d]) for d in sorted(by_d)]


def test_default_oracle_is_the_measured_llapor_hit_rate_with_its_source() -> None:
    measured = llapor_measured()
    assert len(measured) >= 3 and all(0.0 < h <= 1.0 for h in measured)
    p = default_predictor()
    assert p.kind is PredictorKind.oracle
    assert [p.oracle.at(d) for d in range(1, len(measured) + 1)] == measured
    assert p.oracle.hit_rate == measured[0] and "measured" in p.oracle.source and "mixtral-tiny" in p.oracle.source
    # the Hydra default (conf/simulate.yaml) carries the same figures and source as the data file
    node = compose("simulate", SMALL).predictor
    composed = predictor_config(node).oracle
    assert composed.hit_rates == measured and composed.hit_rate == measured[0]
    assert composed.source == oracle_default()["source"] and composed.distance_decay == p.oracle.distance_decay


def test_results_carry_the_hit_rate_source() -> None:
    spec = spec_from_config(compose("simulate", SMALL))
    out = simulate(spec, prepare_routing(spec))
    res = predictor_results(spec, out)
    measured = llapor_measured()
    assert res["predictor_kind"] == "oracle (upper bound)"
    assert res["predictor_hit_rate_target"] == measured[0]
    assert res["predictor_hit_rate_target_by_distance"]["2"] == measured[1]
    assert res["predictor_hit_rate_source"] == oracle_default()["source"]
    hand = replace(spec, predictor=oracle_config(hit_rate=0.95))
    assert "assumed" in predictor_results(hand, simulate(hand, prepare_routing(hand)))["predictor_hit_rate_source"]


def test_oracle_hit_rate_per_distance_reaches_the_predictors() -> None:
    spec = OracleSpec(hit_rate=0.9, hit_rates=[0.9, 0.8], distance_decay=0.5)
    assert [spec.at(d) for d in (1, 2, 3, 4)] == [0.9, 0.8, 0.4, 0.2]
    assert OracleSpec(hit_rate=0.9, distance_decay=0.5).at(3) == pytest.approx(0.225)
    routing = prepare_routing(spec_from_config(compose("simulate", SMALL)))
    cfg = oracle_config(hit_rate=0.9, hit_rates=[0.9, 0.8], distance_decay=0.5)
    preds = make_predictors(cfg, [1, 2, 3], trace=routing.trace)
    assert {d: p.target_hit_rate for d, p in preds.items()} == {1: 0.9, 2: 0.8, 3: 0.4}
    # a hit rate set on the command line over the measured per-distance list fails naming both keys
    with pytest.raises(ValueError, match=r"predictor\.oracle\.hit_rate=0\.5 disagrees with predictor\.oracle\.hit_rates"):
        spec_from_config(compose("simulate", [*SMALL, "predictor.oracle.hit_rate=0.5"]))
    by_hand = spec_from_config(compose("simulate", [*SMALL, "predictor.oracle.hit_rate=0.5", "predictor.oracle.hit_rates=[]"]))
    assert by_hand.predictor.oracle.at(1) == 0.5 and "assumed" in by_hand.predictor.oracle.provenance()


def test_hit_rate_sweep_includes_the_measured_point_and_real_predictors(tmp_path: Path) -> None:
    points = ("0.3", "measured", "1.0")
    rows = run_hit_sweep(("mixtral_8x7b", 4, points, "synthetic", "", tuple(SMALL[2:]), ("v100_pcie3",)))
    by_point = {r["hit_sweep"]: r for r in rows}
    assert list(by_point) == [*points, "transition", "stats", "none"]
    measured = by_point["measured"]
    assert measured["oracle_hit_rate"] == llapor_measured()[0]
    assert measured["predictor_hit_rate_source"] == oracle_default()["source"]
    # the realised d = 1 hit rate follows the oracle's target; a perfect oracle is never wrong
    realised = [by_point[p]["predictor_hit_rate"] for p in points]
    assert realised[0] < realised[1] < realised[2] == 1.0
    assert by_point["transition"]["oracle_hit_rate"] is None and 0.0 <= by_point["transition"]["predictor_hit_rate"] <= 1
    assert by_point["none"]["predictor_kind"] == "none" and all(r["decode_latency_s"] > 0 for r in rows)
    report = write_report(tmp_path, rows).read_text()
    assert "## PreSched vs forecast hit rate" in report
    assert f"| oracle, measured hit rate (default) | {llapor_measured()[0]:.3f} |" in report
    assert oracle_default()["source"] in report
    model, marks = realistic_d1()
    assert f"llapor {marks['llapor']:.3f}" in report and "| transition (real, fitted on held-out routing) |" in report
    assert (tmp_path / "hit_rate_sweep.png").stat().st_size > 1000
