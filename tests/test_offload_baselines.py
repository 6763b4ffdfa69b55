"""Offload baselines walked on hand-made layer states, plus the hot table (LayerScope §4.1)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from conf import compose
from schedulers.hardware import load_hardware
from models.loading import resolve_model_config
from schedulers.base import OFFLOAD, Eviction, LayerState, Phase, SchedulerSetup, Transfer, build_scheduler
from schedulers.cost import CostModel
from schedulers.hot_table import hot_table, per_layer_hot_table, per_layer_slots, rank_experts
from schedulers.offload.hybrimoe import hss_time, hybrid_scheduling
from schedulers.offload.layerwise import greedy_split
from schedulers.policy import routed_share

MS = 1e-3


@functools.lru_cache(maxsize=None)
def cost() -> CostModel:
    cfg = resolve_model_config(compose("simulate", ["model=mixtral_8x7b"]).model)
    c = CostModel(cfg, load_hardware("v100_pcie3"))
    c.beta_s, c.cpu_startup_s, c.t_io = 1 * MS, 1 * MS, 4 * MS  # t_c(m) = m + 1 ms, t_io = 4 ms
    c.gpu_overhead_s = 30e-6  # a fast per-expert GPU call (the calibrated paper profile's 1.1 ms would make t_g > 1 ms)
    return c


def build(kind: str, cache_slots: int = 16, profile: np.ndarray | None = None, **kw):
    settings = OFFLOAD.get(kind).settings(label=kind, **kw)
    prof = profile if profile is not None else np.zeros((4, 8), dtype=np.int64)
    return build_scheduler(settings, SchedulerSetup(num_layers=4, num_experts=8, top_k=2, cache_slots=cache_slots,
                                                    cost=cost(), profile_loads=prof))


def make_state(tokens: list[int], resident_experts: list[int], layer: int = 0, phase: Phase = Phase.decode,
               predicted: dict | None = None, resident: np.ndarray | None = None, cache_slots: int = 16,
               queued: tuple = (), mb: np.ndarray | None = None) -> LayerState:
    t = np.array(tokens, dtype=np.int64)
    if resident is None:
        resident = np.zeros((4, 8), dtype=bool)
        resident[layer, resident_experts] = True
    return LayerState(layer=layer, num_layers=4, phase=phase, tokens=t, scores=t * 0.5, predicted=predicted or {},
                      resident=resident, inflight=(), queued=queued, alpha_s=0.0, cache_slots=cache_slots,
                      free_slots=cache_slots - int(resident.sum()), batch_tokens=int(t.sum()) // 2, context_len=128,
                      hit_rate={1: 0.9}, cost=cost(), t_io_s=cost().t_io, t_attn_next_s=0.5 * MS,
                      tokens_by_microbatch=mb)


# ---- hot table ------------------------------------------------------------------------------------
def test_hot_table_takes_the_globally_hottest() -> None:
    loads = np.array([[5, 1, 9], [7, 7, 0]])
    assert rank_experts(loads).tolist() == [[0, 2], [1, 0], [1, 1], [0, 0], [0, 1], [1, 2]]
    assert hot_table(loads, 3).tolist() == [[False, False, True], [True, True, False]]
    assert hot_table(loads, 0).sum() == 0 and hot_table(loads, 99).all()
    assert per_layer_slots(3, 7).tolist() == [3, 2, 2]
    assert per_layer_hot_table(loads, np.array([1, 2])).tolist() == [[False, False, True], [True, True, False]]


def test_pinned_policies_preload_the_hot_table_until_the_cache_is_full() -> None:
    prof = np.arange(32).reshape(4, 8)
    fid = build("fiddler", cache_slots=10, profile=prof)
    assert fid.initial_residency().sum() == 10 and fid.initial_residency()[3].all()  # no dynamic region
    ls = build("presched", cache_slots=10, profile=prof, dynamic_slots=3)
    start = ls.initial_residency()
    assert start.sum() == 10 and start[3].all() and start[2, 6:].all()  # the ten hottest: budget full
    assert ls.pinned.sum() == 7 and not ls.pinned[2, 6:].any()  # the three least hot of them start the dynamic region
    assert build("presched", cache_slots=10, profile=prof, hot_table=False).initial_residency().sum() == 0


# ---- LayerScope's cache: token-share eviction -----------------------------------------------------
def token_share_cache(kind: str = "presched", **kw):
    """Four slots, nothing pinned, cached loads; layer 0's long-run shares 0.8, 0.6, 0.4, 0.2 (k = 2)."""
    prof = np.zeros((4, 8), dtype=np.int64)
    prof[0, :4] = [40, 30, 20, 10]
    settings = dict(pin_hot_table=False, retain_loads=True, eviction=Eviction.token_share, use_predictor=False)
    return build(kind, cache_slots=4, profile=prof, **{**settings, **kw})


def test_routed_share_compares_passes_of_any_size() -> None:
    assert routed_share(np.array([3, 1, 0]), 2).tolist() == [1.5, 0.5, 0.0]
    assert routed_share(np.array([300, 100, 0]), 2).tolist() == [1.5, 0.5, 0.0]
    assert routed_share(np.zeros((2, 3)), 2).tolist() == [[0.0] * 3] * 2


def test_token_share_evicts_the_lowest_usage_never_below_the_profile_share() -> None:
    ls = token_share_cache()
    assert ls.dynamic_slots == 4 and not ls.pinned.any()  # the hot table starts the cache and pins nothing
    assert ls.initial_residency()[0, :4].all() and ls.initial_residency().sum() == 4
    state = make_state([0, 0, 2, 0, 8, 0, 0, 0], resident_experts=[0, 1, 2, 3], cache_slots=4)
    ls.observe_usage(state)  # U = 0.5 * share + 0.5 * U; shares this pass: expert 2 0.4, expert 4 1.6
    np.testing.assert_allclose(ls.usage[0, :5], [0.4, 0.3, 0.4, 0.1, 0.8])
    # ranked by max(U, profile share): 3 (0.2) < 2 (0.4) < 1 (0.6) < 0 (0.8); by U alone 1 would go before 2
    assert ls.victims(state, 3, set()) == [(0, 3), (0, 2), (0, 1)]
    lru = token_share_cache(eviction=Eviction.lru)
    assert lru.victims(state, 3, set()) == [(0, 0), (0, 1), (0, 2)]  # no use recorded yet: table order


def test_first_layer_experts_make_room_only_for_their_own_layer() -> None:
    prof = np.zeros((4, 8), dtype=np.int64)
    prof[0, :3], prof[1, 3] = [40, 30, 20], 100  # shares: layer 0 0.8, 0.6, 0.4; layer 1's expert 3 2.0
    ls = build("presched", cache_slots=4, profile=prof, pin_hot_table=False, eviction=Eviction.token_share)
    resident = ls.initial_residency()
    assert resident[0, :3].all() and resident[1, 3]
    tokens = [0, 0, 0, 0, 8, 8, 0, 0]
    # no prefetch brings layer 0's experts back: a later layer gives up its own hot expert instead
    assert ls.victims(make_state(tokens, [], layer=1, resident=resident, cache_slots=4), 1, set()) == [(1, 3)]
    assert ls.victims(make_state(tokens, [], layer=0, resident=resident, cache_slots=4), 1, set()) == [(0, 2)]


def test_presched_caches_a_load_in_place_of_the_lowest_share_expert() -> None:
    ls = token_share_cache()
    # experts 4 and 5 miss with 8 tokens each: t_c(8) = 9 ms; eq. 4 loads one (4 ms + t_g), the other runs on the CPU
    plan = ls.plan(make_state([1, 0, 0, 0, 8, 8, 0, 0], resident_experts=[0, 1, 2, 3], cache_slots=4))
    assert plan.cpu == (4,) and plan.ondemand == (5,) and plan.retain == (True,)
    assert plan.evict == ((0, 3),)  # LRU would give up expert 1 (the first unused), token share the coldest
    pinned = token_share_cache(pin_hot_table=True, dynamic_slots=0)
    plan = pinned.plan(make_state([1, 0, 0, 0, 8, 8, 0, 0], resident_experts=[0, 1, 2, 3], cache_slots=4))
    assert plan.ondemand == (5,) and plan.retain == (False,) and plan.evict == ()  # nothing replaceable: staging


def test_a_pass_that_keeps_the_working_set_only_displaces_lower_standing() -> None:
    predicted = {1: np.array([0, 0, 0, 0, 0, 6, 2, 0], dtype=np.float64)}
    state = make_state([0, 0, 0, 0, 0, 0, 0, 4], resident_experts=[0, 1, 2, 3], cache_slots=4, phase=Phase.prefill,
                       predicted=predicted)
    ls = token_share_cache()
    ls.usage[1, 5], ls.usage[1, 6] = 0.5, 0.1
    plan = ls.plan_with_slots(state, (), (7,), (7,), [(1, 5), (1, 6)], keep_working_set=True)
    # (1, 5) at 0.5 takes the slot of (0, 3) at 0.2; (1, 6) at 0.1 would displace (0, 2) at 0.4: dropped
    assert plan.prefetch == ((1, 5),) and plan.evict == ((0, 3),) and plan.retain == (False,)
    assert ls.usage[1, 5] == 0.5  # not raised to the forecast's 1.5
    plan = token_share_cache().plan_with_slots(state, (), (7,), (7,), [(1, 5), (1, 6)])
    assert plan.prefetch == ((1, 5), (1, 6)) and plan.evict == ((0, 3), (0, 2), (0, 1)) and plan.retain == (True,)


def test_a_fresh_prefetch_ranks_by_its_forecast_until_its_layer_runs() -> None:
    lw = token_share_cache("layerwise", use_predictor=True)
    predicted = {1: np.array([0, 0, 0, 0, 0, 0, 3, 1], dtype=np.float64)}
    plan = lw.plan(make_state([1, 1, 0, 0, 0, 0, 0, 0], resident_experts=[0, 1, 2, 3], cache_slots=4,
                              predicted=predicted))
    assert plan.prefetch == ((1, 6), (1, 7)) and plan.evict == ((0, 3), (0, 2))
    np.testing.assert_allclose(lw.usage[1, 6:], [1.5, 0.5])  # the forecast shares, not the idle layer's 0
    with pytest.raises(ValueError, match="scheduler.usage_ema"):
        token_share_cache(usage_ema=0.0)


# ---- HybriMoE ------------------------------------------------------------------------------------
def test_hybrid_scheduling_walk() -> None:
    c = cost()
    t_g = float(c.t_g(1))  # ~0.5 ms at these sizes; all GPU experts cost about the same
    tokens = np.zeros(8, dtype=np.int64)
    tokens[[0, 1, 2, 3]] = [6, 1, 4, 2]  # expert 0 cached; 2, 3, 1 not
    cpu, gpu = hybrid_scheduling(np.array([0]), np.array([1, 2, 3]), tokens, t_io=4 * MS, cost=c)
    # order: cached 0 (6), then uncached 2 (4), 3 (2), 1 (1)
    # step 1: gpu 0 costs t_g vs cpu 1 costs 2 -> GPU takes 0
    # step 2: gpu 2 must wait for its move: 4 - t_g more -> t_g + 4 - t_g + t_g = 4 + t_g > cpu 2 -> CPU takes 1
    # step 3: gpu 2 still 4 + t_g vs cpu 2 + t_c(2) = 5 -> GPU takes 2 (when t_g < 1)
    # step 4: only 3 left: gpu needs a second move (8 + t_g) vs cpu 5 -> CPU takes 3
    assert t_g < 1 * MS
    assert gpu == [0, 2] and cpu == [1, 3]


def test_hybrimoe_plan_caches_loads_and_prefetches_by_prediction() -> None:
    h = build("hybrimoe", cache_slots=8, prefetch_policy="fixed", prefetch_count=2)  # 2 slots per layer; hybrimoe_ls
    resident = np.zeros((4, 8), dtype=bool)
    resident[0, [0, 5]] = True  # layer 0's two slots are full
    tokens = [6, 1, 4, 2, 0, 0, 0, 0]
    pred = np.zeros(8)
    pred[[3, 6, 7]] = [1, 5, 3]
    plan = h.plan(make_state(tokens, [], predicted={1: pred}, resident=resident, cache_slots=8))
    assert plan.gpu[:1] == (0,) and 2 in plan.ondemand and set(plan.cpu) == {1, 3}
    # the load must evict inside layer 0, and never the expert 0 computing now
    assert plan.retain == (True,) and plan.evict == ((0, 5),)
    assert plan.prefetch == ((1, 6), (1, 7))  # top-2 predicted of layer 1
    assert h.priority[0, 0] > 0 and h.priority[0, 5] == 0  # EMA of scores: 0 scored, 5 not


def test_hybrimoe_impact_prefetch_takes_what_shortens_the_next_layers() -> None:
    # layer 0 all resident (no loads): the link has room for (t_g * 4 + t_attn) // t_io transfers; layer 1 predicts
    # 6 (5 tokens), 7 (3), 3 (1). Caching 6 or 7 shortens HSS's layer 1; with both cached, 3 joins the GPU
    # side behind them at no cost, so caching it saves nothing: impact-driven prefetching stops there, while
    # LayerScope's fixed description (hybrimoe_ls) takes the top-3 predicted whatever they save
    import dataclasses

    pred = np.zeros(8)
    pred[[3, 6, 7]] = [1, 5, 3]
    state = dataclasses.replace(make_state([6, 1, 4, 2, 0, 0, 0, 0], [0, 1, 2, 3], predicted={1: pred}),
                                t_io_s=1 * MS, t_attn_next_s=4 * MS)
    c = cost()
    none = np.array([], dtype=np.int64)
    assert hss_time(none, np.array([6, 7, 3]), pred, 1 * MS, c) > hss_time(np.array([6]), np.array([7, 3]), pred, 1 * MS, c)
    assert hss_time(np.array([6, 7]), np.array([3]), pred, 1 * MS, c) == hss_time(np.array([6, 7, 3]), none, pred, 1 * MS, c)
    impact = build("hybrimoe", prefetch_policy="impact").plan(state)
    assert sorted(impact.prefetch) == [(1, 6), (1, 7)]
    fixed = build("hybrimoe", prefetch_policy="fixed", prefetch_count=3).plan(state)
    assert fixed.prefetch == ((1, 6), (1, 7), (1, 3))
    # it looks prefetch_layers (3) ahead: a forecast for layer 2 alone is scored too (the fixed policy: layer 1 only)
    ahead = dataclasses.replace(state, predicted={2: pred})
    assert build("hybrimoe").settings.forecast_window == 3
    assert sorted(build("hybrimoe", prefetch_policy="impact").plan(ahead).prefetch) == [(2, 6), (2, 7)]
    # no room on the link (the next attention hides nothing, transfers as long as the layer): no prefetch
    busy = dataclasses.replace(state, t_io_s=40 * MS, t_attn_next_s=0.0)
    assert build("hybrimoe", prefetch_policy="impact").plan(busy).prefetch == ()


def test_hybrimoe_gives_a_slot_freed_by_one_eviction_to_one_prefetch() -> None:
    # every layer's 2 slots full (8 slots): impact prefetching into layer 1 must evict one of its experts per
    # prefetch; handing the one slot an eviction frees to two prefetches broke the slot contract in the executor
    import dataclasses

    resident = np.zeros((4, 8), dtype=bool)
    resident[:, [0, 1]] = True
    pred = np.zeros(8)
    pred[[3, 6, 7]] = [1, 5, 3]
    state = dataclasses.replace(make_state([6, 1, 0, 0, 0, 0, 0, 0], [], predicted={1: pred}, resident=resident,
                                           cache_slots=8), t_io_s=1 * MS, t_attn_next_s=4 * MS)
    plan = build("hybrimoe", cache_slots=8, prefetch_policy="impact").plan(state)
    assert plan.prefetch and sum(1 for layer, _ in plan.evict if layer == 1) == len(plan.prefetch)
    plan.validate(state)


def test_hybrimoe_prefill_runs_everything_on_the_gpu() -> None:
    h = build("hybrimoe")
    plan = h.plan(make_state([600, 100, 400, 0, 0, 0, 0, 0], [0], phase=Phase.prefill))
    assert plan.cpu == () and set(plan.ondemand) == {1, 2} and plan.prefetch == ()


# ---- Fiddler, kTransformers, on-demand, LRU, Fate, Klotski ----------------------------------------
def test_fiddler_chooses_per_expert_cpu_or_transfer() -> None:
    f = build("fiddler")
    # t_c: 1 token -> 2 ms < 4 ms + t_g (CPU); 6 tokens -> 7 ms > 4 + t_g (transfer)
    plan = f.plan(make_state([6, 1, 0, 0, 0, 0, 0, 3], [7]))
    assert plan.cpu == (1,) and plan.ondemand == (0,) and plan.gpu == (7, 0) and plan.prefetch == ()


def test_ktransformers_never_transfers_in_decode() -> None:
    k = build("ktransformers", prefill_gpu_min_tokens=100)
    plan = k.plan(make_state([6, 1, 0, 0, 0, 0, 0, 3], [7]))
    assert plan.ondemand == () and plan.cpu == (0, 1) and plan.gpu == (7,)
    pre = k.plan(make_state([600, 100, 0, 0, 0, 0, 0, 300], [7], phase=Phase.prefill))
    assert pre.cpu == () and pre.ondemand == (0, 1)


def test_ondemand_and_lru() -> None:
    od = build("ondemand").plan(make_state([1, 5, 0, 3, 0, 0, 0, 0], [3]))
    assert od.cpu == () and od.ondemand == (1, 0) and od.retain == (False, False)
    lru = build("lru", cache_slots=8)  # 2 slots per layer
    resident = np.zeros((4, 8), dtype=bool)
    resident[0, [2, 4]] = True
    lru.last_used[0, 2], lru.last_used[0, 4] = 5, 9  # 2 is the least recently used
    plan = lru.plan(make_state([0, 3, 0, 0, 0, 0, 0, 0], [], resident=resident, cache_slots=8))
    assert plan.ondemand == (1,) and plan.retain == (True,) and plan.evict == ((0, 2),)


def test_fate_prefetches_every_predicted_expert_and_keeps_queued_loads_first() -> None:
    f = build("fate", dynamic_slots=8)
    pred = np.zeros(8)
    pred[[1, 2, 5]] = [2, 6, 1]
    queued = (Transfer(0, 3), Transfer(1, 4))
    plan = f.plan(make_state([1, 0, 0, 2, 0, 4, 0, 0], [], predicted={1: pred}, queued=queued))
    assert plan.ondemand == (3, 5, 0)  # the queued (0, 3) keeps its place, then hottest first
    assert plan.prefetch == ((1, 2), (1, 1), (1, 5))


def test_klotski_loads_the_first_microbatch_first_and_prefetches_hot_experts() -> None:
    prof = np.zeros((4, 8), dtype=np.int64)
    prof[1] = [0, 9, 0, 7, 0, 0, 1, 0]
    k = build("klotski", profile=prof, prefetch_count=2, hot_table=False)
    assert k.micro_batches == 2
    mb = np.zeros((2, 8), dtype=np.int64)
    mb[0, [0, 2]] = [1, 1]
    mb[1, [0, 5]] = [1, 5]
    plan = k.plan(make_state([2, 0, 1, 0, 0, 5, 0, 0], [], mb=mb))
    assert plan.ondemand == (0, 2, 5)  # micro-batch 0's experts (hottest first), then the rest
    assert plan.prefetch == ((1, 1), (1, 3))


def test_layerwise_greedy_split_minimises_the_layer() -> None:
    c = cost()
    # E_cur ascending tokens 1, 2, 6: t_c = 2, 3, 7; loads of the hottest ones cost 4 ms each
    i = greedy_split(np.array([1.0, 2.0, 6.0]), ready_gpu_s=0.0, alpha=0.0, t_io=4 * MS, t_g=0.0, cost=c)
    # i=0: max(0, 12); i=1: max(2, 8); i=2: max(5, 4) = 5; i=3: max(12, 0) -> i = 2
    assert i == 2
