"""The planning code's fast paths compute what its general paths compute, bit for bit: a plan is a chain of float
comparisons, so a shortcut that rounds one sum differently could change a split or a prefetch count. Each test runs
both paths of one function on random layers and asserts exact equality (`bench_planning.py --base-tree` checks whole
plans against another checkout)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from core.routing_stats import TransitionTable
from schedulers.base import Eviction, LayerPlan, LayerState, Phase, SchedulerSetup, Transfer, build_scheduler
from schedulers.cost import CostModel
from schedulers.hardware import load_hardware
from schedulers.offload import horizon, layerwise, presched
from schedulers.offload.horizon import HorizonSettings, Split, layer_time
from schedulers.policy import split_by_availability
from tests.test_presched import mixtral


@pytest.fixture(scope="module")
def cost() -> CostModel:
    c = CostModel(mixtral(), load_hardware("a100_pcie4"))
    c.call_overhead_s = 0.2e-3  # a device call's dispatch (0 on this profile): `with_dispatch` must place it
    return c


def test_greedy_split_on_python_floats_equals_numpy(cost: CostModel, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(0)
    cases = []
    for _ in range(400):
        n = int(rng.integers(0, layerwise._PYTHON_UP_TO + 1))
        m = np.sort(rng.integers(0, 40, n)).astype(np.float64)  # zeros too: t_c(0) = 0
        # resident work and link backlog up to several transfers: the GPU side may bound even the all-CPU split
        ready, alpha = float(rng.uniform(0, 60e-3)), float(rng.uniform(0, 40e-3))
        t_io, t_g = float(rng.uniform(0.5e-3, 15e-3)), float(rng.uniform(0, 5e-3))
        cases.append((m, ready, alpha, t_io, t_g))
    python = [layerwise.greedy_split(m.tolist(), *rest, cost) for m, *rest in cases]
    # each expert's CPU time handed in (Horizon's candidate split reads them from the layer's table)
    given = [layerwise.greedy_split(m.tolist(), *rest, cost, t_cpu=[cost.t_c(x) for x in m.tolist()])
             for m, *rest in cases]
    assert given == python
    monkeypatch.setattr(layerwise, "_PYTHON_UP_TO", -1)
    numpy = [layerwise.greedy_split(m, *rest, cost) for m, *rest in cases]
    assert python == numpy
    assert len(set(python)) > 5  # the cases reach many different splits


def many_expert_state(cost: CostModel, rng: np.random.Generator, landing: int) -> LayerState:
    """One layer of 96 experts, most of them missing, some landing from started transfers."""
    E = 96
    tokens = rng.integers(0, 12, E).astype(np.int64)
    resident = rng.random((4, E)) < 0.2
    active = np.flatnonzero(tokens)
    inflight = tuple(Transfer(1, int(e), float(rng.uniform(0, 5e-3))) for e in rng.choice(active, landing, False))
    return LayerState(layer=1, num_layers=4, phase=Phase.decode, tokens=tokens, scores=tokens * 0.5, predicted={},
                      resident=resident, inflight=inflight, queued=(), alpha_s=float(rng.uniform(0, 3e-3)),
                      cache_slots=200, free_slots=0, batch_tokens=int(tokens.sum()), context_len=512, hit_rate={},
                      cost=cost, t_io_s=cost.t_io, t_attn_next_s=1e-4)


def test_layer_time_long_link_queue_in_numpy_equals_the_loop(cost: CostModel,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(1)
    cases = []
    for trial in range(30):
        s = many_expert_state(cost, rng, landing=trial % 3)
        ready, missing = split_by_availability(s)
        order = rng.permutation(missing).tolist()
        cut = int(rng.integers(0, len(order) // 3))
        loads = tuple(order[cut:])
        held = sorted(rng.choice(ready, min(2, ready.size), False).tolist()) if trial % 2 else []
        assert len(loads) + len(held) > horizon._QUEUE_NUMPY_FROM
        cases.append((s, Split("x", tuple(order[:cut]), tuple(ready.tolist()) + loads, loads), held))
    numpy = [layer_time(s, split, held) for s, split, held in cases]
    monkeypatch.setattr(horizon, "_QUEUE_NUMPY_FROM", 10**9)
    for s, _, _ in cases:
        s.__dict__.pop("_horizon_parts", None)  # the memo of group sums holds no queue; rebuilt alike
    loop = [layer_time(s, split, held) for s, split, held in cases]
    assert numpy == loop


@pytest.mark.parametrize("T,k,E", [(1, 2, 8), (128, 2, 8), (2, 8, 128), (128, 8, 128), (32, 6, 64), (7, 5, 61)])
def test_transition_scores_add_source_rows_in_order(T: int, k: int, E: int) -> None:
    """`TransitionTable.scores` sums a token's source rows over [k, T, E] blocks: the values the strided
    `conditional()[src].sum(axis=1)` gives (then the prior)."""
    rng = np.random.default_rng(T * k * E)
    table = TransitionTable(E)
    table.fit(rng.integers(0, E, (500, k)), rng.integers(0, E, (500, k)))
    src = rng.integers(0, E, (T, k)).astype(np.int32)
    prior = table.target_freq / max(table.target_freq.sum(), 1)
    reference = table.conditional()[src.astype(np.int64)].sum(axis=1) + 1e-6 * prior
    assert np.array_equal(table.scores(src), reference)


def test_with_dispatch_on_a_list_equals_on_an_array(cost: CostModel) -> None:
    rng = np.random.default_rng(2)
    for _ in range(50):
        m = rng.integers(0, 3, int(rng.integers(1, 12)))
        shares = cost.t_g_shares(m)
        assert np.array_equal(cost.with_dispatch(shares.tolist(), m.tolist()), cost.with_dispatch(shares, m))
    assert np.array_equal(cost.with_dispatch([1.0, 2.0], [0, 0]), [1.0, 2.0])  # nothing live: no dispatch added


def test_split_by_availability_is_made_once_and_read_only(cost: CostModel) -> None:
    s = many_expert_state(cost, np.random.default_rng(3), landing=2)
    ready, missing = split_by_availability(s)
    assert split_by_availability(s)[0] is ready
    landing = {t.expert for t in s.inflight}
    assert landing <= set(ready.tolist()) and not landing & set(missing.tolist())
    with pytest.raises(ValueError):
        missing[0] = 0  # a caller may not change what the next one reads


def horizon_with_usage(cost: CostModel, rng: np.random.Generator):
    settings = HorizonSettings(hot_table=False, eviction=Eviction.token_share)  # as conf/scheduler/horizon.yaml
    sched = build_scheduler(settings, SchedulerSetup(num_layers=4, num_experts=96, top_k=8,
                                                                              cache_slots=200, cost=cost))
    sched.usage[:] = rng.random(sched.usage.shape) * 0.3  # usage to rank by (standing: never below the profile's)
    return sched


def admitted_one_key_at_a_time(sched, state: LayerState, plan: LayerPlan) -> LayerPlan:
    """The walk of `Horizon.admitted` asking `next_use_key` for one expert at a time (its former code)."""
    kept = [i for i, r in enumerate(plan.retain) if r]
    evict, retain = list(plan.evict), list(plan.retain)
    while kept and evict:
        load = sched.next_use_key(state, np.array([state.layer]), np.array([plan.ondemand[kept[-1]]]))[0]
        victim = evict[-1]
        if load > sched.next_use_key(state, np.array([victim[0]]), np.array([victim[1]]))[0]:
            break
        retain[kept.pop()] = False
        evict.pop()
    return replace(plan, retain=tuple(retain), evict=tuple(evict))


def test_admitted_keys_in_one_call_walk_as_one_at_a_time(cost: CostModel) -> None:
    rng = np.random.default_rng(4)
    outcomes = set()
    for _ in range(60):
        s = many_expert_state(cost, rng, landing=0)
        sched = horizon_with_usage(cost, rng)
        _, missing = split_by_availability(s)
        loads = tuple(rng.permutation(missing)[:int(rng.integers(1, 8))].tolist())
        cached = np.argwhere(s.resident)
        evict = tuple(map(tuple, cached[rng.choice(len(cached), int(rng.integers(0, 8)), False)].tolist()))
        plan = LayerPlan(gpu=loads, ondemand=loads, retain=tuple(rng.random(len(loads)) < 0.7), evict=evict)
        got = sched.admitted(s, plan)
        assert got == admitted_one_key_at_a_time(sched, s, plan)
        outcomes.add(len(got.evict) - len(plan.evict))
    assert len(outcomes) > 2  # walks that stop at once, after some, and never


def test_evictable_spares_landing_and_protected_experts(cost: CostModel) -> None:
    rng = np.random.default_rng(5)
    s = many_expert_state(cost, rng, landing=3)
    for t in s.inflight:
        s.resident[t.layer, t.expert] = True  # started transfers of cached experts (re-fetches into a kept slot)
    sched = horizon_with_usage(cost, rng)
    protect = {(1, int(e)) for e in np.flatnonzero(s.resident[1])[:4]}
    layers, experts = sched.evictable(s, protect)
    got = set(zip(layers.tolist(), experts.tolist()))
    spared = protect | {(t.layer, t.expert) for t in s.inflight}
    assert not got & spared
    assert got == {(int(l), int(e)) for l, e in np.argwhere(s.resident) if l != 0} - spared  # layer 0: its own loads


def test_scalar_and_array_cost_paths_agree(cost: CostModel) -> None:
    """The plans mix `t_g(m)` / `t_c(m)` on one float with the same over an array (`next_layer`, `greedy_split`):
    both paths must give the same values, 0 included."""
    m = np.concatenate([[0.0, 1.0], np.random.default_rng(6).uniform(0, 300, 200), np.arange(1, 65)])
    assert [cost.t_g(x) for x in m.tolist()] == cost.t_g(m).tolist()
    assert [cost.t_c(x) for x in m.tolist()] == cost.t_c(m).tolist()


def test_count_tables_give_the_elementwise_times(cost: CostModel) -> None:
    """`CostModel.count_times` looks integer token counts up in tables: the values of `t_g`, `t_c` and `t_g_shares`
    on the same counts, and remade when a cost parameter changes (or a count outgrows them)."""
    rng = np.random.default_rng(8)
    for top in (3, 40, 300, 5000):
        m = rng.integers(0, top + 1, 128)
        t_g, t_c, shares = cost.count_times(m)
        assert np.array_equal(t_g, cost.t_g(m)) and np.array_equal(t_c, cost.t_c(m))
        assert np.array_equal(shares, cost.t_g_shares(m))
    before = cost.count_times(np.arange(5))[0]
    saved = cost.gpu_overhead_s
    try:
        cost.gpu_overhead_s = saved + 1e-3  # the roofline study zeroes overheads on a built model: tables follow
        assert np.array_equal(cost.count_times(np.arange(5))[0], cost.t_g(np.arange(5)))
        assert not np.array_equal(cost.count_times(np.arange(5))[0], before)
    finally:
        cost.gpu_overhead_s = saved


def test_cross_layer_queue_loop_equals_numpy(cost: CostModel, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(9)
    cases = []
    for _ in range(200):
        n, k = int(rng.integers(0, 12)), int(rng.integers(0, 12))
        cur, nxt = rng.permutation(64)[:n].tolist(), rng.permutation(64)[:k].tolist()
        cases.append((cur, rng.integers(1, 6, n).astype(float).tolist(), nxt, rng.integers(1, 6, k).astype(float).tolist(),
                      float(rng.uniform(0, 4e-3)), float(rng.uniform(0.5e-3, 3e-3)), float(rng.uniform(0, 1e-3)),
                      float(rng.uniform(0, 2e-3)), cost, float(rng.uniform(0, 8e-3)) * (rng.random() < 0.5)))
    loop = [presched.cross_layer_queue(*c) for c in cases]
    monkeypatch.setattr(presched, "_NUMPY_FROM", -1)
    assert loop == [presched.cross_layer_queue(*c) for c in cases]
    assert len({q.in_gpu_queue.count(True) for q in loop}) > 4  # queues of many lengths


def test_lookahead_candidates_sorted_as_sorted_by(cost: CostModel) -> None:
    """E_next from the predicted experts' forecasts alone: ascending forecast, ties by id, as `sorted_by` over every
    expert's forecast gave."""
    rng = np.random.default_rng(10)
    for _ in range(50):
        s = many_expert_state(cost, rng, landing=2)
        pred = rng.integers(0, 4, 96).astype(np.float64)
        s = replace(s, predicted={2: pred})
        ahead = presched.Lookahead(s, True, [], [], 0.0, cost.t_io, 0.0, 0.0, 0.0)
        some = [e for e in np.flatnonzero(pred > 0).tolist() if not s.available(2)[e]]
        want = presched.sorted_by(some, pred.tolist())
        assert ahead.candidates(2) == (want, [float(pred[e]) for e in want])


def test_standing_gathers_flat_as_in_two_dimensions(cost: CostModel) -> None:
    rng = np.random.default_rng(11)
    sched = horizon_with_usage(cost, rng)
    layers, experts = rng.integers(0, 4, 500), rng.integers(0, 96, 500)
    want = np.maximum(sched.usage[layers, experts], sched.profile_share[layers, experts])
    assert np.array_equal(sched.standing(layers, experts), want)
    assert np.array_equal(sched.standing(layers.tolist(), experts.tolist()), want)  # lists and tuples alike


def searched_horizon(cost: CostModel, priced: bool):
    settings = HorizonSettings(hot_table=False, max_window=3, search_cost_us=1e-3 if priced else None)
    return build_scheduler(settings, SchedulerSetup(num_layers=4, num_experts=8, top_k=2, cache_slots=16, cost=cost))


def test_horizon_defers_presched_prefetches_to_the_plans_that_run_them(cost: CostModel) -> None:
    """A searched decode plan that sizes its own count of l+1's prefetches reads no forecast past l+1 (PreSched's Q4
    list is not made); one without a sized count runs PreSched's list, as before. `presched_next_count` (what a priced
    search weighs its saving against) counts PreSched's l+1 prefetches without making the list."""
    from tests.test_presched import ReadCounter, random_state

    rng = np.random.default_rng(12)
    counted = sized = unsized = 0
    capped = 0
    for priced in (False, True):
        sched = searched_horizon(cost, priced)
        finish = sched.finish

        def check(state, cpu, gpu, loads, prefetch, keep, ahead=None):
            nonlocal counted, capped
            full = presched.PreSched._decode_prefetch(sched, state, ahead, ahead.gap)
            want = sum(1 for target, _ in full if target == state.layer + 1)
            assert horizon.presched_next_count(sched, state, ahead) == want
            counted += want > 0
            capped += 0 < want < sched._prefetch_counts(state, ahead.gap)[1][0]  # fewer candidates than the count
            return finish(state, cpu, gpu, loads, prefetch, keep, ahead)

        sched.finish = check
        for _ in range(300):
            st = random_state(rng, cost, layer=int(rng.integers(0, 2)))
            st = replace(st, t_io_s=st.t_io_s * float(rng.choice([1.0, 0.05])))  # a fast link: counts above |E_next|
            if st.phase is not Phase.decode:
                continue
            counter = ReadCounter(st.predicted)
            sched.finish = finish
            plan = sched.plan(replace(st, predicted=counter))
            nxt = st.layer + 1 in st.predicted and horizon.next_layer(st)
            if sched.searched and nxt and nxt.experts:  # the search sizes l+1's count: no further forecast read
                assert set(counter.read) <= {st.layer + 1}
                sized += 1
            elif any(t > st.layer + 1 for t, _ in plan.prefetch):
                unsized += 1  # PreSched's Q4 prefetch of a later layer ran
            sched.finish = check
            sched.plan(replace(st, predicted=st.predicted))
    assert counted and capped and sized and unsized


@pytest.mark.slow
def test_bench_planning_compares_every_plan_with_another_tree() -> None:
    """`bench_planning.py --base-tree`: this tree against itself in two worker processes, alternated; every plan of
    both systems the same, a time for each side."""
    from pathlib import Path

    from engine.bench import bench_planning

    root = Path(bench_planning.__file__).resolve().parents[2]
    out = bench_planning.main(["--points", "mixtral_8x7b:1", "--gen-len", "2", "--repeats", "2",
                               "--base-tree", str(root)])
    for system in ("presched", "horizon"):
        assert out[f"mixtral_8x7b b1 {system} plans identical"] is True
        median, p99, n = out[f"mixtral_8x7b b1 {system}@base"]
        assert n == out[f"mixtral_8x7b b1 {system}"][2] > 0 and 0 < median <= p99
