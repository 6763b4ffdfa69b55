"""Horizon (the default offload scheduler) and DALI: their rules walked by hand on small layer states, Horizon's plan
blind to routing it has not seen, and Horizon against every baseline on a small simulated run.

The hand-built states reuse test_presched's cost model: Mixtral on the V100 profile with eq. 2 and the transfer set to
round numbers (ms): t_c(m) = m + 1, t_io = 4, t_g ~0.5 (roofline + a 30 us call), no CPU hand-over cost.
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import replace

import numpy as np
import pytest

from engine.bench.bench_simulate_sweep import scheduler_settings
from engine.sim.run import RunSpec, build_sim, prepare_routing, simulate
from engine.sim.workload import layer_loads
from predictors.config import PredictorConfig, PredictorKind
from schedulers.base import Eviction, LayerState, Phase, PlanningPrice, SchedulerSetup, build_scheduler
from schedulers.cost import CostModel
from schedulers.hardware import load_hardware
from schedulers.offload.dali import DALISettings, greedy_assignment
from schedulers.offload.horizon import HorizonSettings, Recent, Split, candidate_splits, layer_time
from tests.test_presched import A, B, C, MS, mixtral

R1, R2 = 5, 6  # resident experts


@pytest.fixture(scope="module")
def cost() -> CostModel:
    c = CostModel(mixtral(), load_hardware("v100_pcie3"))
    c.beta_s, c.cpu_startup_s, c.t_io, c.cpu_dispatch_s = 1 * MS, 1 * MS, 4 * MS, 0.0
    c.gpu_overhead_s = 30e-6
    assert c.t_g(4) < 1 * MS
    return c


def layer_state(cost: CostModel, predicted: dict | None = None) -> LayerState:
    """Layer 0 of 4: A(1), B(2), C(4) tokens missing, R1(3), R2(3) resident."""
    tokens = np.zeros(8, dtype=np.int64)
    tokens[[A, B, C, R1, R2]] = [1, 2, 4, 3, 3]
    resident = np.zeros((4, 8), dtype=bool)
    resident[:, [R1, R2]] = True
    return LayerState(layer=0, num_layers=4, phase=Phase.decode, tokens=tokens, scores=tokens * 0.5,
                      predicted=predicted or {}, resident=resident, inflight=(), queued=(), alpha_s=0.0, cache_slots=16,
                      free_slots=16 - int(resident.sum()), batch_tokens=6, context_len=512, hit_rate={1: 0.8},
                      cost=cost, t_io_s=cost.t_io, t_attn_next_s=1 * MS)


def build(settings, cost: CostModel):
    return build_scheduler(settings, SchedulerSetup(num_layers=4, num_experts=8, top_k=2, cache_slots=16, cost=cost))


def test_layer_time_plays_the_layer_as_the_mechanism_does(cost: CostModel) -> None:
    s = layer_state(cost)
    tg = lambda m: float(cost.t_g(m))  # noqa: E731
    # A, B on the CPU (2 + 3 ms); C loaded at 4 ms then computed; R1, R2 in one call meanwhile
    split = Split("x", (A, B), (R1, R2, C), (C,))
    gpu = max(cost.t_g_group_sum([3, 3]), 4 * MS) + tg(4)
    assert layer_time(s, split) == pytest.approx(max(5 * MS, gpu))
    # everything missing loaded: the link is the bottleneck, 3 transfers back to back
    split = Split("y", (), (R1, R2, C, B, A), (C, B, A))
    assert layer_time(s, split) == pytest.approx(12 * MS + tg(1))


def test_horizon_takes_the_fastest_candidate_split(cost: CostModel) -> None:
    """Eq. 4 (PreSched) walks i' from the coldest: T_G(i'=1) = 8 + t_g < T_C = 2 fails, i'=2: 4 + t_g < 5 passes,
    so PreSched puts A, B on the CPU; HSS with resident experts movable does better here (R1 to the CPU while C
    loads): Horizon must pick whichever candidate `layer_time` says is fastest, and never a slower one."""
    s = layer_state(cost)
    plan = build(HorizonSettings(hot_table=False), cost).plan(copy.deepcopy(s))
    plan.validate(s)
    chosen = layer_time(s, Split("plan", plan.cpu, plan.gpu, plan.ondemand))
    others = candidate_splits(s, ["greedy", "hss", "all_cpu", "all_gpu"], may_move_resident=True)
    presched = build(scheduler_settings("presched"), cost).plan(copy.deepcopy(s))
    times = {c.name: layer_time(s, c) for c in others}
    times["presched"] = layer_time(s, Split("p", presched.cpu, presched.gpu, presched.ondemand))
    assert chosen == pytest.approx(min(times.values()))
    assert set(presched.cpu) == {A, B} and presched.ondemand == (C,)
    # the all-CPU split (10 ms) and the all-GPU split (12.5 ms) lose to both hybrid ones
    assert times["all_cpu"] == pytest.approx(10 * MS) and chosen < times["all_cpu"] and chosen < times["all_gpu"]


def test_horizon_prefetches_within_the_slots(cost: CostModel) -> None:
    predicted = {1: np.array([0, 0, 0, 5, 4, 0, 0, 3], dtype=np.float64)}
    s = replace(layer_state(cost, predicted), free_slots=1)
    plan = build(HorizonSettings(hot_table=False), cost).plan(copy.deepcopy(s))
    plan.validate(s)  # slots: retained loads + prefetches within free + evicted
    assert all(target == 1 for target, _ in plan.prefetch)


def sizing_state(cost: CostModel) -> LayerState:
    """Layer 0 of 4, nothing resident: E0 (3 tokens), E6 (8), E7 (8); the forecast of layer 1: E4 (6), E5 (3)."""
    tokens = np.zeros(8, dtype=np.int64)
    tokens[[0, 6, 7]] = [3, 8, 8]
    predicted = {1: np.array([0, 0, 0, 0, 6, 3, 0, 0], dtype=np.float64)}
    return LayerState(layer=0, num_layers=4, phase=Phase.decode, tokens=tokens, scores=tokens * 0.5,
                      predicted=predicted, resident=np.zeros((4, 8), dtype=bool), inflight=(), queued=(), alpha_s=0.0,
                      cache_slots=16, free_slots=16, batch_tokens=19, context_len=512, hit_rate={1: 0.8}, cost=cost,
                      t_io_s=cost.t_io, t_attn_next_s=1 * MS)


def test_horizon_sizes_its_prefetches_for_the_split_it_runs(cost: CostModel) -> None:
    """Layer 0 of 4, nothing resident: E0 (3 tokens), E6 (8), E7 (8); the forecast of layer 1: E4 (6), E5 (3).
    PreSched: eq. 4 passes at i' = 2 (4 + t_g < t_c(3, 8) = 13), so E0, E6 on the CPU (13 ms) and E7 loaded; eq. 5's
    gap 13 - 4 = 9 ms gives f = (9 + 1) / 4 = 2.5 -> 3 prefetches (both of layer 1's). Eq. 1's split is faster here
    (E0 on the CPU, 4 ms; E7, E6 loaded, landing at 4 and 8 ms: ~8.5 ms), and it leaves the link no idle time: its
    next gate is at 9.5 ms, so with k prefetches (landing at 12, 16) layer 1 takes
    k = 0: E4 loaded (4 + t_g), E5 on the CPU (4): ~4.5 ms; k = 1: E4 lands 2.5 ms after the gate, E5 on the CPU: 4 ms;
    k = 2: E5 lands at 6.5 ms: ~7 ms. One prefetch, not PreSched's two."""
    s = sizing_state(cost)
    presched = build(scheduler_settings("presched"), cost).plan(copy.deepcopy(s))
    assert presched.cpu == (0, 6) and presched.ondemand == (7,) and presched.prefetch == ((1, 4), (1, 5))
    plan = build(HorizonSettings(hot_table=False), cost).plan(copy.deepcopy(s))
    plan.validate(s)
    assert plan.cpu == (0,) and set(plan.ondemand) == {6, 7}
    assert plan.prefetch == ((1, 4),)


def test_horizon_skips_its_search_on_a_layer_shorter_than_the_search(cost: CostModel) -> None:
    """`search_cost_us`: the layer of the test above without a forecast of layer 1 (the search weighs this layer
    alone), whose PreSched split ends in 13 ms (E0, E6 on the CPU, E7 loaded meanwhile). A search dearer than that
    keeps PreSched's plan; a cheaper one searches (eq. 1's split, ~8.5 ms). With the forecast the search may save more
    than this layer lasts (the next layer's loads), and it searches first whatever it costs."""
    s = replace(sizing_state(cost), predicted={})
    assert layer_time(s, Split("presched", (0, 6), (7,), (7,))) == pytest.approx(13 * MS)
    skipped = build(HorizonSettings(hot_table=False, search_cost_us=13.5e3), cost).plan(copy.deepcopy(s))
    assert skipped.cpu == (0, 6) and skipped.ondemand == (7,)
    searched = build(HorizonSettings(hot_table=False, search_cost_us=12.5e3), cost).plan(copy.deepcopy(s))
    assert searched.cpu == (0,) and set(searched.ondemand) == {6, 7}
    ahead = build(HorizonSettings(hot_table=False, search_cost_us=13.5e3), cost).plan(copy.deepcopy(sizing_state(cost)))
    assert ahead.cpu == (0,) and ahead.prefetch == ((1, 4),)
    with pytest.raises(ValueError, match="search_cost_us"):
        HorizonSettings(search_cost_us=-1.0)


def test_horizon_skips_a_search_that_lately_saved_less_than_it_costs(cost: CostModel) -> None:
    """The same layer: searched, eq. 1's split with one prefetch ends both layers ~1.5 ms sooner than PreSched's split
    with its two (by the cost model). A search dearer than that on average (12.5 ms) is skipped once a pass of searches
    (4 layers) has measured it, until every `search_probe`-th plan; a cheaper one (1 ms) keeps searching."""
    presched = (0, 6), (7,)
    searched = (0,), (6, 7)

    def splits(budget_us: float, plans: int) -> list[tuple]:
        horizon = build(HorizonSettings(hot_table=False, search_cost_us=budget_us, search_probe=3), cost)
        out = [horizon.plan(copy.deepcopy(sizing_state(cost))) for _ in range(plans)]
        return [(p.cpu, tuple(sorted(p.ondemand))) for p in out]

    assert splits(12.5e3, 7) == [searched] * 4 + [presched, presched, searched]
    assert splits(1e3, 7) == [searched] * 7


def test_horizon_backs_off_its_probes_where_the_search_keeps_not_paying(cost: CostModel) -> None:
    """The same layer and price: the first pass of searches saves less than they cost, so the layer's next plans skip
    it; each probe that still finds it not paying doubles the interval to the next (3, then 6, up to
    `search_probe_max`)."""
    horizon = build(HorizonSettings(hot_table=False, search_cost_us=12.5e3, search_probe=3, search_probe_max=6), cost)
    searched = [bool(horizon.plan(copy.deepcopy(sizing_state(cost))).cpu == (0,)) for _ in range(20)]
    assert [i for i, s in enumerate(searched) if s] == [0, 1, 2, 3, 6, 12, 18]
    with pytest.raises(ValueError, match="search_probe_max"):
        HorizonSettings(search_probe=9, search_probe_max=8)


def test_recent_values_mean_and_median_as_a_pass_over_them() -> None:
    rng = np.random.default_rng(0)
    values = rng.exponential(size=40).tolist()
    recent = Recent(7)
    for i, v in enumerate(values):
        recent.add(v)
        last = values[max(0, i - 6):i + 1]
        assert len(recent) == len(last) and recent.median() == statistics.median(last)
        assert recent.mean() == pytest.approx(sum(last) / len(last), rel=1e-12)


class Ticks:
    """A clock that advances `step_s` each time it is read: a search read twice costs exactly `step_s` on it."""

    def __init__(self, step_s: float):
        self.now, self.step_s = 0.0, step_s

    def __call__(self) -> float:
        self.now += self.step_s
        return self.now


@pytest.mark.parametrize("price", ["free", "fixed", "clock_dear", "clock_cheap"])
def test_horizon_prices_its_search_by_what_the_run_charges(cost: CostModel, price: str) -> None:
    """The default Horizon (`search_cost_us` None) learns its search's price from the run (`SchedulerSetup.planning`):
    free (the simulator's default), it searches every plan, as before; with a fixed price of 12.5 ms per search, or a
    clock on which its search takes 12.5 ms, it skips the search after a pass of 4 searches (which saved ~1.5 ms each,
    above); where the search takes 0.1 ms on the run's clock it keeps searching. Before its first search on a clock it
    does not know its time, and searches."""
    prices = {"free": PlanningPrice(), "fixed": PlanningPrice(search_s=12.5 * MS),
              "clock_dear": PlanningPrice(clock=Ticks(12.5 * MS)), "clock_cheap": PlanningPrice(clock=Ticks(0.1 * MS))}
    setup = SchedulerSetup(num_layers=4, num_experts=8, top_k=2, cache_slots=16, cost=cost, planning=prices[price])
    horizon = build_scheduler(HorizonSettings(hot_table=False), setup)
    plans = [horizon.plan(copy.deepcopy(sizing_state(cost))) for _ in range(6)]
    searched = [p.cpu == (0,) for p in plans]
    assert searched == [True] * 4 + ([False] * 2 if price in ("fixed", "clock_dear") else [True] * 2)
    if price.startswith("clock"):
        timed = (sum(searched) + 3) // 4  # the 1st, 5th, ... search is timed (a thread clock read is a system call)
        assert list(horizon.search_times[19].values) == pytest.approx([prices[price].clock.step_s] * timed)


def test_horizon_evicts_the_expert_whose_layer_comes_back_last(cost: CostModel) -> None:
    """At layer 2 of 4 the cache holds E1 of layers 1 and 3: layer 3 runs next in this pass (comes back in 1 layer),
    layer 1 only in the next one (in 3), so layer 1's expert goes first (usage per layer to its next use 0.25 / 3
    against 0.1 / 1), though its usage stands higher (PreSched's token-share order: layer 3's)."""
    s = layer_state(cost)
    resident = np.zeros((4, 8), dtype=bool)
    resident[[1, 3], 1] = True
    s = replace(s, layer=2, resident=resident, free_slots=0)
    for next_use, victim in ((True, (1, 1)), (False, (3, 1))):
        h = build(HorizonSettings(hot_table=False, eviction=Eviction.token_share, evict_next_use=next_use), cost)
        h.usage[1, 1], h.usage[3, 1] = 0.25, 0.1
        assert h.victims(s, 1, set()) == [victim]


def test_horizon_runs_the_fastest_split_in_a_prefill_pass_too(cost: CostModel) -> None:
    """In a prefill pass PreSched takes eq. 1's split of the missing experts; Horizon times its candidates there too
    (DALI's list assignment among them) and runs the fastest. E0-E2 resident, E3-E7 missing with 1, 1, 1, 4, 4
    tokens, a device call 2 ms (as the paper profiles' 1.1 ms, above a transfer's share): PreSched runs E3-E5 on the
    CPU and loads E7, E6 (12.45 ms), Horizon E6 on the CPU too and loads E7 only (11 ms); `prefill_candidates:
    false` is PreSched's prefill split."""
    slow = copy.copy(cost)
    slow.gpu_overhead_s = 2 * MS
    tokens = np.array([1, 1, 1, 1, 1, 1, 4, 4], dtype=np.int64)
    resident = np.zeros((4, 8), dtype=bool)
    resident[:, :3] = True
    s = replace(layer_state(slow), phase=Phase.prefill, tokens=tokens, scores=tokens * 0.5, batch_tokens=14,
                resident=resident, free_slots=4)
    presched = build(scheduler_settings("presched"), slow).plan(copy.deepcopy(s))
    plan = build(HorizonSettings(hot_table=False), slow).plan(copy.deepcopy(s))
    plan.validate(s)
    splits = candidate_splits(s, ["greedy", "hss", "dali", "all_cpu", "all_gpu"], may_move_resident=True)
    times = [layer_time(s, c) for c in splits]
    times.append(layer_time(s, Split("p", presched.cpu, presched.gpu, presched.ondemand)))
    chosen = layer_time(s, Split("plan", plan.cpu, plan.gpu, plan.ondemand))
    assert chosen == pytest.approx(min(times)) and times[-1] == pytest.approx(12.45 * MS, abs=0.01 * MS)
    assert chosen == pytest.approx(11 * MS, abs=0.01 * MS) and set(plan.cpu) == {3, 4, 5, 6} and plan.ondemand == (7,)
    old = build(HorizonSettings(hot_table=False, prefill_candidates=False), slow).plan(copy.deepcopy(s))
    assert (old.cpu, old.ondemand) == (presched.cpu, presched.ondemand) == ((3, 4, 5), (7, 6))
    dali = next(c for c in splits if c.name == "dali")  # the candidate is DALI's own assignment
    cpu, _, loads, _ = greedy_assignment(s, may_move_resident=True)
    assert (list(dali.cpu), list(dali.loads)) == (cpu, loads)


def test_horizon_keeps_a_load_only_where_it_beats_what_it_displaces(cost: CostModel) -> None:
    """Layer 2 of 4, the cache full (R1, R2 of layers 1 and 3 may go); C is loaded. Usage alike (0.3): C is next used
    a pass (4 layers) later, 0.3 / 4 = 0.075 per layer, layer 1's experts in 3 layers, 0.1: keeping C would evict an
    expert needed sooner, so C passes through staging and nothing is evicted. With layer 1's R1 cold (0.05 / 3) C
    stays and R1 goes; `admit_loads: false` keeps C whatever it displaces."""
    s = replace(layer_state(cost), layer=2, free_slots=0)
    settings = HorizonSettings(hot_table=False, retain_loads=True, eviction=Eviction.token_share)
    h = build(settings, cost)
    h.usage[:] = 0.3
    plan = h.plan_with_slots(s, (A, B), (R1, R2, C), (C,), [])
    assert plan.retain == (False,) and plan.evict == ()
    h.usage[1, R1] = 0.05
    plan = h.plan_with_slots(s, (A, B), (R1, R2, C), (C,), [])
    assert plan.retain == (True,) and plan.evict == ((1, R1),)
    h = build(replace(settings, admit_loads=False), cost)
    h.usage[:] = 0.3
    plan = h.plan_with_slots(s, (A, B), (R1, R2, C), (C,), [])
    assert plan.retain == (True,) and len(plan.evict) == 1


def test_dali_greedy_assignment_by_hand(cost: CostModel) -> None:
    """Descending workload, each expert to the side that finishes it first (GPU after its transfer):
    C(4): GPU 4 + t_g < CPU 5; R1(3): GPU ~5 > CPU 4 -> CPU; R2(3): GPU ~5 < CPU 8; B(2): GPU 8 + t_g > CPU 7 -> CPU;
    A(1): GPU 8 + t_g < CPU 9 -> GPU (loaded after C)."""
    s = layer_state(cost)
    cpu, gpu, loads, span = greedy_assignment(s, may_move_resident=True)
    assert cpu == [R1, B] and gpu == [C, R2, A] and loads == [C, A]
    assert span == pytest.approx(max(7 * MS, 8 * MS + float(cost.t_g(1))))
    # where the device is the host, resident experts stay on it
    cpu, gpu, loads, _ = greedy_assignment(s, may_move_resident=False)
    assert R1 in gpu and R2 in gpu and R1 not in cpu
    plan = build(DALISettings(hot_table=False, retain_loads=True), cost).plan(copy.deepcopy(s))
    plan.validate(s)
    assert set(plan.cpu) == {R1, B} and plan.ondemand == (C, A)


def small_spec(scheduler: str = "horizon", batch: int = 4) -> RunSpec:
    from conf import compose
    from models.loading import resolve_model_config

    node = compose("simulate", ["model=mixtral_8x7b"]).model
    return RunSpec(model=resolve_model_config(node), model_name=str(node.name), hardware=load_hardware("a100_pcie4"),
                   scheduler=scheduler_settings(scheduler), batch_size=batch, prompt_len=32, gen_len=6,
                   predictor=PredictorConfig(name="transition", kind=PredictorKind.transition), seed=3,
                   check_invariants=True)


def recorded_plans(spec: RunSpec, routing) -> list[tuple[int, int, object]]:
    sim, _, _ = build_sim(spec, routing)
    plans: list[tuple[int, int, object]] = []
    inner = sim.scheduler.plan

    def record(state: LayerState):
        plan = inner(state)
        plans.append((sim.accounting.pass_index, state.layer, plan))
        return plan

    sim.scheduler.plan = record  # type: ignore[method-assign]
    sim.run(routing.passes)
    return plans


def test_horizon_plan_ignores_routing_it_has_not_seen() -> None:
    """Change the routing of the last pass after layer l: every plan up to layer l of that pass (and of every earlier
    pass) is unchanged; a later one differs (the change matters). The forecasts are the transition table's, fitted on
    held-out routing and reading only the layers already run."""
    spec = small_spec()
    routing = prepare_routing(spec)
    before = recorded_plans(spec, routing)
    changed = copy.deepcopy(routing)
    last = changed.passes[-1]
    l_cut = 10
    E = spec.model.num_experts
    ex = changed.trace.experts
    ex[l_cut + 1:, last.rows] = (ex[l_cut + 1:, last.rows] + 3) % E  # another expert set, still k distinct per token
    last.loads, last.scores = layer_loads(changed.trace, last.rows)
    after = recorded_plans(spec, changed)
    assert len(before) == len(after)
    last_index = last.index
    for (p, layer, a), (_, _, b) in zip(before, after):
        if p < last_index or layer <= l_cut:
            assert a == b, (p, layer)
    assert any(a != b for (p, layer, a), (_, _, b) in zip(before, after) if p == last_index and layer > l_cut)


def test_horizon_beats_every_baseline_on_a_small_run() -> None:
    systems = ["presched", "hybrimoe", "klotski", "layerwise", "fiddler", "dali"]
    thr = {}
    for name in ["horizon", *systems]:
        spec = small_spec(name)
        thr[name] = simulate(spec).summary["throughput_tok_s"]
    best = max(systems, key=thr.__getitem__)
    assert thr["horizon"] >= thr[best], thr
    # one batch in flight: no worse than PreSched, whose split is among its candidates
    one = replace(small_spec("horizon"), scheduler=replace(scheduler_settings("horizon"), batches_in_flight=1))
    assert simulate(one).summary["throughput_tok_s"] >= thr["presched"] * 0.99, thr


def test_horizon_prefetches_the_next_steps_first_layer_at_the_last_layer(cost: CostModel) -> None:
    """`next_step_layers: 1`. Layer 0 of a decode step routed E2 (3 tokens), E3 (2), E7 (2), R1 (4); at the last layer
    (3 of 4) only R1, R2 are active and resident: the plan runs them in one device call (under 1 ms) and the link is
    idle; with the next attention 9 ms the next step's first gate is ~9.5 ms away, room for two 4-ms transfers. The
    candidates are layer 0's routed experts not cached (R1 is): E2 (3 tokens), then E7 and E3 (2 each; E7's usage is
    higher): E2 and E7 are prefetched for layer 0. With one free slot, E7 must displace an expert: the victim by the
    eviction key is layer 2's R1 (usage 0.3 over the 3 layers until layer 2 comes back = 0.1); E7 (usage 0.05, needed
    in 1 layer: 0.05) does not beat it, so only E2 goes; at usage 0.5 it does, and layer 2's R1 is evicted. Off
    (`next_step_layers: 0`), and in a prefill step, the last layer prefetches nothing."""
    first = layer_state(cost)
    tokens0 = np.zeros(8, dtype=np.int64)
    tokens0[[2, 3, 7, R1]] = [3, 2, 2, 4]
    first = replace(first, tokens=tokens0, scores=tokens0 * 0.5, batch_tokens=11)
    last_tokens = np.zeros(8, dtype=np.int64)
    last_tokens[[R1, R2]] = [3, 3]
    last = replace(layer_state(cost), layer=3, tokens=last_tokens, scores=last_tokens * 0.5, t_attn_next_s=9 * MS)

    def run(settings: HorizonSettings, free: int, usage7: float, phase: Phase = Phase.decode):
        h = build(settings, cost)
        h.plan(copy.deepcopy(replace(first, phase=phase)))
        h.usage[:] = 0.3
        h.usage[0, 3], h.usage[0, 7] = 0.04, usage7
        s = replace(last, free_slots=free)
        plan = h.plan(copy.deepcopy(s))
        plan.validate(s)
        return plan

    on = HorizonSettings(hot_table=False, next_step_layers=1)
    plan = run(on, 8, 0.05)
    assert plan.gpu == (R1, R2) and not plan.ondemand and plan.cpu == ()
    assert plan.prefetch == ((0, 2), (0, 7)) and plan.evict == ()
    plan = run(on, 1, 0.05)
    assert plan.prefetch == ((0, 2),) and plan.evict == ()
    plan = run(on, 1, 0.5)
    assert plan.prefetch == ((0, 2), (0, 7)) and plan.evict == ((2, R1),)
    assert run(replace(on, next_step_layers=0), 8, 0.05).prefetch == ()
    assert run(on, 8, 0.05, Phase.prefill).prefetch == ()  # the first layer's routing seen was a prefill's


def test_horizon_with_cross_step_prefetches_ignores_routing_it_has_not_seen() -> None:
    """With the cross-step prefetch on (the next step's first two layers), change every layer's routing of the last
    pass: every plan of the earlier passes is unchanged, the previous pass's last layer (which prefetched for the
    changed pass) included; the run's invariants (slots, link) hold with prefetches for an earlier layer index."""
    spec = small_spec(batch=16)
    spec = replace(spec, scheduler=replace(spec.scheduler, next_step_layers=2))
    routing = prepare_routing(spec)
    before = recorded_plans(spec, routing)
    last = routing.passes[-1].index
    crossing = [plan for p, layer, plan in before if p == last - 1 and any(t < layer for t, _ in plan.prefetch)]
    assert crossing  # the step before the changed one prefetched for it
    changed = copy.deepcopy(routing)
    fp = changed.passes[-1]
    ex = changed.trace.experts
    ex[:, fp.rows] = (ex[:, fp.rows] + 3) % spec.model.num_experts
    fp.loads, fp.scores = layer_loads(changed.trace, fp.rows)
    after = recorded_plans(spec, changed)
    assert [(p, layer, plan) for p, layer, plan in before if p < last] == \
        [(p, layer, plan) for p, layer, plan in after if p < last]
    assert any(a != b for (p, _, a), (_, _, b) in zip(before, after) if p == last)
