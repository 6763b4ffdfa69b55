"""The bound with the cache carried from pass to pass (`engine.sim.bounds.continuity_bound`, `most_hits`): the hit
count by hand and against brute force, and the bound itself on a tiny trace where it can be written down."""

from __future__ import annotations

import copy
from itertools import combinations, product

import numpy as np
import pytest

from core.trace import DECODE, TraceMeta, TraceRecorder
from engine.sim.bounds import (_LAMBDAS, continuity_bound, convex_slopes, exact_best_pass, layer_floor, lower_bound,
                               most_hits, pass_fixed_time, pass_segments, segment_bound)
from engine.sim.pipeline import PipelineSim, SimOptions
from engine.sim.workload import ForwardPass, forward_passes
from schedulers.base import LayerPlan
from schedulers.cost import CostModel
from schedulers.hardware import load_hardware
from tests.test_presched import MS, mixtral
from tests.test_simulator import ListPolicy, one_decode_pass
from tests.test_simulator import mixtral as mixtral_layers


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


# ---- the segment bound (`segment_bound`): whole splits, the slots charged per segment of layers ------------------
def one_pass(cfg, loads: np.ndarray) -> ForwardPass:
    return ForwardPass(index=0, batch_id=0, phase=DECODE, rows=np.arange(1), num_seqs=1, context_len=16, loads=loads,
                       scores=loads * 0.5)


def top1_pass(cfg, expert: int):
    """(trace, passes) of one decode token routed to one expert (top-1) at the config's single MoE layer."""
    rec = TraceRecorder(TraceMeta(model="t", num_experts=cfg.num_experts, top_k=1, moe_layers=cfg.moe_layers))
    rec.add_step([np.array([[expert]])], [np.ones((1, 1))], seq=np.array([0]), pos=np.array([100]), phase=DECODE)
    trace = rec.build()
    return trace, forward_passes(trace)


def test_segment_bound_takes_a_whole_split_where_the_multipliers_take_half(slow_cpu: CostModel) -> None:
    """One MoE layer, one token routed to one expert, no slot. On the CPU it takes A(1) = attention + t_c (1000 s);
    on the GPU A(0) = attention + the device call, and the transfer takes t_io = 2000 s. The best schedule is the CPU:
    A(1). The multipliers can only mix the two: min(lam t_io + (1 - lam) A(0), (1 - lam) A(1)) is at most about
    2/3 A(1) (at lam ~ 1/3), so `lower_bound` says about two thirds; `segment_bound` takes the whole split,
    min(max(A(0), t_io), A(1)) = A(1), plus the pass's head and fixed time: the optimum itself (the simulator's CPU
    plan)."""

    cfg = mixtral_layers(1)
    cost = copy.copy(slow_cpu)
    cost.beta_s, cost.cpu_dispatch_s = 0.0, 0.0
    trace, passes = top1_pass(cfg, 0)
    fp = passes[0]
    t_attn, t_shared, fixed = pass_fixed_time(cfg, cost, fp)
    a = layer_floor(cost, fp.loads[0], t_attn, t_shared)
    assert a[1] == pytest.approx(t_attn + 1000.0) and a[0] < 1.0
    cost.t_io = 2000.0
    assert segment_bound(cfg, cost, passes, 0) == pytest.approx(a[1] + fixed)
    assert lower_bound(cfg, cost, passes, 0) < 0.7 * (a[1] + fixed)
    on_cpu = PipelineSim(cfg=cfg, cost=cost, scheduler=ListPolicy(np.zeros((1, 8), dtype=bool), [LayerPlan(cpu=(0,))]),
                         cache_slots=1, staging_slots=1, trace=trace, options=SimOptions(check_invariants=True))
    assert on_cpu.run_pass(fp) == pytest.approx(a[1] + fixed)
    # one slot: the expert may be resident, the GPU's A(0) is the bound; the old one can say no more
    assert segment_bound(cfg, cost, passes, 1) == pytest.approx(a[0] + fixed)


def test_segment_bound_cuts_a_pass_where_its_layers_differ(slow_cpu: CostModel) -> None:
    """Two MoE layers, every expert on the GPU (the CPU at 1000 s), one slot. Layer 0 routes three experts, layer 1
    one. One segment: max(A0 + A1, 3 t_io) (4 uses, 1 slot). Cut after layer 0: max(A0, 2 t_io) + max(A1, 0) (layer
    0's three uses find at most one slot filled at the pass's start, and its two transfers cannot overlap layer 1).
    With t_io = 100 ms and each layer's compute small the one segment is the larger, 3 t_io; with 150 ms of host time
    before each layer's plan (A0, A1 ~ 154 ms) and t_io = 120 ms the cut is: 2 t_io + A1 = 0.24 s + A1 > max(A0 +
    A1, 0.36 s), where `lower_bound` says max(A0 + A1, 3 t_io) at most."""
    cfg = mixtral_layers(2)
    cost = copy.copy(slow_cpu)
    loads = np.zeros((2, 8), dtype=np.int64)
    loads[0, :3], loads[1, 0] = 1, 1
    passes = [one_pass(cfg, loads)]
    t_attn, t_shared, fixed = pass_fixed_time(cfg, cost, passes[0])
    a0 = float(layer_floor(cost, loads[0], t_attn, t_shared)[0])
    a1 = float(layer_floor(cost, loads[1], t_attn, t_shared)[0])
    assert a0 + a1 < 0.1
    assert segment_bound(cfg, cost, passes, 1) == pytest.approx(fixed + 0.3)
    cost.layer_overhead_s, cost.t_io = 0.15, 0.12  # host time before each layer's plan: counted with the attention
    t_attn, t_shared, fixed = pass_fixed_time(cfg, cost, passes[0])
    a0 = float(layer_floor(cost, loads[0], t_attn, t_shared)[0])
    a1 = float(layer_floor(cost, loads[1], t_attn, t_shared)[0])
    assert 0.12 < a0 < 0.24 and 0.12 < a1 and 0.24 + a1 > max(a0 + a1, 0.36)
    assert segment_bound(cfg, cost, passes, 1) == pytest.approx(fixed + 0.24 + a1)
    assert lower_bound(cfg, cost, passes, 1) <= fixed + max(a0 + a1, 0.36) + 1e-9


def brute_force_segments(cfg, cost: CostModel, fp: ForwardPass, capacity: int) -> float:
    """The most over every cut of the pass of the sum over its segments of the least over every split of the
    segment's layers of max(compute, t_io (GPU uses - capacity)+): `pass_segments` without the convex envelope."""
    t_attn, t_shared, _ = pass_fixed_time(cfg, cost, fp)
    floors = [layer_floor(cost, fp.loads[layer], t_attn, t_shared) for layer in range(fp.loads.shape[0])]
    L = len(floors)

    def value(a: int, b: int) -> float:
        best = np.inf
        for js in product(*(range(f.size) for f in floors[a:b + 1])):
            uses = sum(f.size - 1 - j for f, j in zip(floors[a:b + 1], js))
            compute = sum(float(f[j]) for f, j in zip(floors[a:b + 1], js))
            best = min(best, max(compute, cost.t_io * max(uses - capacity, 0)))
        return best

    out = -np.inf
    for cuts in product((False, True), repeat=L - 1):
        edges = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [L]
        out = max(out, sum(value(a, b - 1) for a, b in zip(edges, edges[1:])))
    tail = cost.t_head(fp.num_seqs) + cost.pass_overhead_s
    return out + tail


def envelope(values: np.ndarray) -> np.ndarray:
    base, slopes = convex_slopes(values)
    return base + np.concatenate([[0.0], np.cumsum(slopes)])


def test_convex_slopes_is_the_lower_convex_envelope() -> None:
    """By hand: 0, 3, 4, 8 has the envelope 0, 2, 4, 8 (the point 3 lies above the chord from 0 to 4); a convex
    sequence is its own envelope."""
    assert envelope(np.array([0.0, 3.0, 4.0, 8.0])) == pytest.approx([0.0, 2.0, 4.0, 8.0])
    assert envelope(np.array([5.0, 2.0, 1.0, 3.0])) == pytest.approx([5.0, 2.0, 1.0, 3.0])
    assert envelope(np.array([7.0])) == pytest.approx([7.0])


def test_segment_bound_is_the_brute_force_over_cuts_and_splits() -> None:
    """Random three-layer Mixtral passes, a cost model where CPU and link compete: `pass_segments` (merged convex
    envelopes, a DP over cuts) is at most the brute force over every cut and split, equal where every layer's A is
    convex in its GPU uses, and never below `lower_bound`."""

    cfg = mixtral_layers(3)
    cost = CostModel(cfg, load_hardware("v100_pcie3"))
    cost.beta_s, cost.cpu_startup_s, cost.t_io = 1 * MS, 2 * MS, 3 * MS
    rng = np.random.default_rng(1)
    exact = 0
    for _ in range(8):
        loads = np.where(rng.random((3, 8)) < 0.4, rng.integers(1, 6, (3, 8)), 0)
        fp = one_pass(cfg, loads)
        t_attn, t_shared, _ = pass_fixed_time(cfg, cost, fp)
        convex = all(np.allclose(envelope(f[::-1]), f[::-1])
                     for f in (layer_floor(cost, fp.loads[i], t_attn, t_shared) for i in range(3)))
        for capacity in (0, 2, 5):
            ours = pass_segments(cfg, cost, fp, capacity, cost.t_io)
            brute = brute_force_segments(cfg, cost, fp, capacity)
            assert ours <= brute + 1e-12
            if convex:
                exact += 1
                assert ours == pytest.approx(brute)
            assert segment_bound(cfg, cost, [fp], capacity) >= lower_bound(cfg, cost, [fp], capacity) - 1e-12
    assert exact >= 6


def test_segment_bound_never_exceeds_the_exact_search() -> None:
    """Tiny passes (three MoE layers, one token routed to two experts each) where `exact_best_pass` enumerates every
    CPU/GPU split and prefetch of LayerScope's action space from a given cache, in the simulator itself: the segment
    bound (any schedule, any starting cache of the slots) is at most that optimum, for links from fast to slow."""
    cfg = mixtral_layers(3)
    rng = np.random.default_rng(4)
    for t_io in (2 * MS, 6 * MS, 20 * MS):
        cost = CostModel(cfg, load_hardware("v100_pcie3"))
        cost.beta_s, cost.cpu_startup_s, cost.t_io = 1 * MS, 3 * MS, t_io
        pairs = [list(rng.choice(8, 2, replace=False)) for _ in range(3)]
        trace, passes = one_decode_pass(cfg, pairs)
        fp = passes[0]
        pinned = np.zeros((3, 8), dtype=bool)
        start = pinned.copy()
        start[0, pairs[0][0]] = True  # one of layer 0's experts cached
        best, _ = exact_best_pass(cfg, cost, trace, fp, pinned, cache_slots=1, staging_slots=2, initial=start)
        assert lower_bound(cfg, cost, [fp], 3) <= segment_bound(cfg, cost, [fp], 3) <= best * (1 + 1e-9)
