"""The simulator's speed-ups keep every number: `t_c_prefix` in numpy adds in the loop's order, and the routing-only
predictors fitted once per routing hand each run a fresh copy (a run scores its forecasts as it goes, and eq. 6 reads
the hit rate measured so far). `engine/bench/bench_sim_speed.py --baseline-tree` checks whole study points
bit-identical against another checkout."""

from __future__ import annotations

import numpy as np

from engine.sim.run import prepare_routing, simulate
from schedulers.cost import CostModel
from schedulers.hardware import load_hardware
from tests.test_horizon import small_spec
from tests.test_presched import mixtral


def test_t_c_prefix_in_numpy_adds_as_the_loop_does() -> None:
    cost = CostModel(mixtral(), load_hardware("a100_pcie4"))
    cost.cpu_dispatch_s = 3.7e-5
    rng = np.random.default_rng(0)
    for n in (25, 40, 130):  # the numpy branch (long lists), zeros before and among the live experts
        ms = [0.0, 0.0] + rng.integers(0, 9, n).astype(float).tolist()
        want, acc, seen = [], 0.0, False
        for m in ms:
            if m > 0:
                acc += cost.beta_s * m + cost.cpu_startup_s
                seen = True
            want.append(acc + cost.cpu_dispatch_s if seen else acc)
        assert cost.t_c_prefix(ms) == want  # exact: the same sums in the same order


def test_fitted_predictors_are_shared_by_runs_of_one_routing_and_start_fresh() -> None:
    spec = small_spec("presched")
    routing = prepare_routing(spec)
    first = simulate(spec, routing).summary
    assert sorted(d for _, d in routing.fitted) == [1, 2, 3]  # one fit per distance PreSched reads
    assert all(not p.stats.total for p in routing.fitted.values())  # the runs scored copies, not the fits
    again = simulate(spec, routing).summary
    fresh = simulate(spec, prepare_routing(spec)).summary
    assert again["throughput_tok_s"] == first["throughput_tok_s"] == fresh["throughput_tok_s"]
    assert again["total_s"] == first["total_s"] == fresh["total_s"]
