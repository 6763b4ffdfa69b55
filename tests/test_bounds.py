"""The bound with the cache carried from pass to pass (`engine.sim.bounds.continuity_bound`, `most_hits`): the hit
count by hand and against brute force, and the bound itself on a tiny trace where it can be written down."""

from __future__ import annotations

import copy
from itertools import combinations

import numpy as np
import pytest

from core.trace import DECODE
from engine.sim.bounds import (_LAMBDAS, continuity_bound, layer_floor, lower_bound, most_hits, pass_fixed_time)
from engine.sim.workload import ForwardPass
from schedulers.cost import CostModel
from schedulers.hardware import load_hardware
from tests.test_presched import MS, mixtral


def alternating(passes: int, experts: int = 8) -> list[np.ndarray]:
    """One MoE layer; pass p routes one token to expert p % 2."""
    out = []
    for p in range(passes):
        loads = np.zeros((1, experts), dtype=np.int64)
        loads[0, p % 2] = 1
        out.append(loads)
    return out


def test_most_hits_by_hand() -> None:
    """Experts 0 and 1 alternate over 6 passes, one slot. A use is a hit only where its expert stayed cached since its
    previous use (or since the start): the intervals on the gate clock are e0 (-1, 0], (0, 2], (2, 4] and e1 (-1, 1],
    (1, 3], (3, 5]; one slot holds e0's three (each starts where the last ended), so 3 of the 6 uses, where the best
    cache per pass would count one hit in every pass (6). Two slots hold all six; every expert used every pass: one
    hit per slot and pass."""
    assert most_hits(alternating(6), 1) == 3
    assert most_hits(alternating(6), 2) == 6
    every = [np.ones((2, 3), dtype=np.int64)] * 4
    assert most_hits(every, 2) == 8 and most_hits(every, 6) == 24 and most_hits(every, 0) == 0


def brute_force_hits(loads: list[np.ndarray], capacity: int) -> int:
    L, E = loads[0].shape
    intervals, last = [], {}
    for p, tokens in enumerate(loads):
        for layer, e in zip(*np.nonzero(tokens)):
            here = p * L + int(layer)
            intervals.append((last.get((int(layer), int(e)), -1), here))
            last[int(layer), int(e)] = here
    horizon = len(loads) * L
    for size in range(len(intervals), -1, -1):
        for chosen in combinations(intervals, size):
            cover = np.zeros(horizon, dtype=np.int64)
            for a, b in chosen:
                cover[a + 1:b + 1] += 1
            if cover.max(initial=0) <= capacity:  # intervals on a line: `capacity` slots hold them iff so
                return size
    return 0


def test_most_hits_is_the_largest_set_the_slots_hold() -> None:
    rng = np.random.default_rng(0)
    for _ in range(12):
        loads = [(rng.random((2, 2)) < 0.6).astype(np.int64) for _ in range(3)]
        for capacity in (1, 2):
            assert most_hits(loads, capacity) == brute_force_hits(loads, capacity)


@pytest.fixture(scope="module")
def slow_cpu() -> CostModel:
    """Mixtral's cost model with a CPU expert taking ~1000 s and a transfer 100 ms: every schedule loads."""
    c = CostModel(mixtral(), load_hardware("v100_pcie3"))
    c.cpu_startup_s, c.t_io = 1000.0, 100 * MS
    return c


def test_continuity_bound_on_a_tiny_trace(slow_cpu: CostModel) -> None:
    """Six decode passes of one token, one MoE layer, experts 0 and 1 alternating, one slot. With the CPU out of
    reach every use runs on the GPU: a (attention + one expert's device call + dense parts) of compute per pass, and
    the link brings every use that is not a hit. Best cache per pass (`lower_bound`): one hit per pass, no transfer
    left, 6a. Carried over: 3 hits (`test_most_hits_by_hand`), so 3 transfers (300 ms): the multiplier grid's best is
    lam = 0.95, nu = 1: 0.05 x 6a + 0.95 x 0.3 s (lam = 1 would take the CPU at no charge)."""
    cfg = mixtral()
    passes = [ForwardPass(index=p, batch_id=0, phase=DECODE, rows=np.arange(1), num_seqs=1, context_len=16,
                          loads=loads, scores=loads * 0.5) for p, loads in enumerate(alternating(6))]
    t_attn, t_shared, fixed = pass_fixed_time(cfg, slow_cpu, passes[0])
    a = float(layer_floor(slow_cpu, passes[0].loads[0], t_attn, t_shared)[0]) + fixed
    assert a < 0.05 and _LAMBDAS[-2] == pytest.approx(0.95)
    assert lower_bound(cfg, slow_cpu, passes, 1) == pytest.approx(6 * a)
    assert continuity_bound(cfg, slow_cpu, passes, 1) == pytest.approx(0.05 * 6 * a + 0.95 * 0.3)
    # with a slot per expert nothing is lost by carrying the cache: both bounds are the compute
    assert continuity_bound(cfg, slow_cpu, passes, 2) == pytest.approx(lower_bound(cfg, slow_cpu, passes, 2))
    # a prefill pass keeps its own best cache, as in `lower_bound`
    prefill = copy.copy(passes[0])
    prefill.phase = 0
    assert continuity_bound(cfg, slow_cpu, [prefill], 1) == lower_bound(cfg, slow_cpu, [prefill], 1)
