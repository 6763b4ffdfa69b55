"""The physical serverless layer time (the offload CostModel's weight streaming in every replica), the
keep-alive window's billing, MoEless's copy-aware and cost-aware re-placement, and CRAFT's budgeted knapsack.

Each test names the mutation it was checked against (README, "MoEless at its own strength")."""

from __future__ import annotations

import numpy as np
import pytest

from conf import compose
from engine.serverless.latency_model import LatencyKind, LatencySettings, ServerlessCostModel
from engine.serverless.policies import SystemSpec
from engine.serverless.serving_trace import replay_with_synthetic_routing
from engine.serverless.simulator import forecast_loads, simulate_system
from engine.serverless.slots import SlotMap
from engine.synthetic_routing import SyntheticRouter
from engine.workloads import load_azure_trace
from models.loading import resolve_model_config
from predictors.oracle import NoisyOraclePredictor
from schedulers.cost import CostModel
from schedulers.ep_placement import Placement, ReplicaTiming
from schedulers.hardware import load_hardware
from schedulers.serverless.craft import CRAFTSettings, allocate
from schedulers.serverless.moeless import MoElessPolicy, MoElessSettings, copy_seconds


@pytest.fixture(scope="module")
def mixtral():
    return resolve_model_config(compose("serve").model)


@pytest.fixture(scope="module")
def trace(mixtral):
    azure = load_azure_trace("conv").clipped(96, 24)
    window = azure.window(azure.busiest_window(1.0), 1.0)
    return replay_with_synthetic_routing(window.per_interval(1.0), SyntheticRouter.for_model(mixtral), seed=0,
                                         decode_stride=4)


def test_layer_time_streams_every_serving_replicas_weights(mixtral):
    """Mutation caught: a roofline replica time without the weight-streaming term (alpha * W only)."""
    hw = load_hardware("a6000")
    cm = ServerlessCostModel(mixtral, hw, 8)
    assert cm.settings.kind is LatencyKind.roofline  # the default for every system
    ops = CostModel(mixtral, hw)
    stream = cm.expert_bytes / (hw.gpu.hbm_gbps * 1e9 * hw.gpu.hbm_efficiency)
    assert stream == pytest.approx(336 * 2**20 / (768e9 * 0.559))  # Mixtral's 336 MiB expert at the fitted 429 GB/s
    one = np.array([1.0, 0, 0, 0, 0, 0, 0, 0])
    static = Placement.from_lists(8, 8, [(e, e) for e in range(8)])
    t = cm.moe_time(static, one)
    assert t.compute_s == pytest.approx(float(ops.t_g(1))) and t.compute_s >= stream  # one token reads the whole expert
    # two replicas of expert 0 on one device read its weights twice; spread over two devices once each
    two_here = Placement.from_lists(8, 8, [(0, 0), (0, 0)] + [(e, e) for e in range(1, 8)])
    two_apart = Placement.from_lists(8, 8, [(0, 0), (0, 1)] + [(e, e) for e in range(1, 8)])
    loads = np.array([8.0, 0, 0, 0, 0, 0, 0, 0])
    assert cm.moe_time(two_here, loads).compute_s == pytest.approx(2 * float(ops.t_g(4)))
    assert cm.moe_time(two_apart, loads).compute_s == pytest.approx(float(ops.t_g(4)))
    # the all-to-all: latency plus the busiest device's hidden states over its share of the fabric
    assert t.comm_s == pytest.approx(hw.interconnect.latency_us * 1e-6 + cm.beta_s)
    # the paper's §3.3 formula, a labelled option: compute only, ~9x below the physical time at decode sizes
    paper = ServerlessCostModel(mixtral, hw, 8, LatencySettings(kind=LatencyKind.paper))
    assert paper.moe_time(static, one).compute_s == pytest.approx(paper.alpha_s)
    assert paper.moe_time(static, np.full(8, 16.0)).moe_s * 5 < cm.moe_time(static, np.full(8, 16.0)).moe_s


def test_keep_alive_holds_and_bills_an_idle_replica_until_its_window_ends():
    """Mutation caught: a kept-alive replica not counted as resident (held memory billing nothing for it)."""
    slots = SlotMap(2, 2, 2)
    both = Placement.from_lists(2, 2, [(0, 0), (0, 1), (1, 1)])
    one = Placement.from_lists(2, 2, [(0, 0), (1, 1)])
    slots.apply(both, now_s=0.0)
    assert slots.resident_replicas() == 3
    slots.apply(one, now_s=0.5)  # expert 0's replica on device 1 idles, kept alive
    slots.expire(0.5, keep_alive_s=1.0)
    assert slots.resident_replicas() == 3 and (0, 1) in slots.live().pairs()
    slots.apply(one, now_s=0.9)
    assert slots.expire(0.9, keep_alive_s=1.0) == 0 and slots.resident_replicas() == 3  # 0.9 s idle < 1 s
    slots.apply(one, now_s=1.2)
    assert slots.expire(1.2, keep_alive_s=1.0) == 1 and slots.resident_replicas() == 2  # 1.2 s after its last use
    assert (0, 1) not in slots.live().pairs()
    # keep_alive 0 frees at once; None (the paper loop) never
    zero, never = SlotMap(2, 2, 2), SlotMap(2, 2, 2)
    for m, ka in ((zero, 0.0), (never, None)):
        m.apply(both, 0.0)
        m.apply(one, 0.0)
        m.expire(0.0, ka)
    assert zero.resident_replicas() == 2 and never.resident_replicas() == 3


def test_keep_alive_window_is_billed_in_the_simulation(trace, mixtral):
    """The held memory (and the held cost) of MoEless grows with its keep-alive window."""
    cm = ServerlessCostModel(mixtral, load_hardware("a6000"), 8)
    fc, _ = forecast_loads(trace, NoisyOraclePredictor(trace.routing, distance=1, hit_rate=0.9))
    held = {}
    for ka in (0.0, 10.0):
        res = simulate_system(trace, SystemSpec(MoElessSettings(label=f"ka {ka}", keep_alive_s=ka)), fc, cm)
        held[ka] = res.summary()["held_memory_time_avg_gib"]
        in_use = res.replicas.sum(axis=1) * cm.expert_bytes  # [S] replicas the placements use, all layers
        assert np.all(res.held_bytes[:, 0] >= in_use - 1e-6)
        if ka == 0.0:
            np.testing.assert_allclose(res.held_bytes[:, 0], in_use)  # nothing idle is held
    assert held[10.0] > held[0.0] * 1.05


def _timing(copy_s: float) -> ReplicaTiming:
    return ReplicaTiming(replica_times=lambda w: np.where(np.asarray(w) > 0, 1e-3 + 1e-4 * np.asarray(w), 0.0),
                         comm_per_token_s=0.0, comm_latency_s=0.0, peer_copy_s=copy_s, host_copy_s=2 * copy_s)


def test_copy_aware_moeless_moves_only_when_the_saving_repays_the_copy():
    """Mutation caught: `_repays` ignoring the copy time (every better plan taken)."""
    E, G = 4, 2
    placements = {}
    for copy_s in (1e-6, 10.0):
        policy = MoElessPolicy.from_settings(MoElessSettings(copy_aware=True, lifetime_iterations=64.0), E, G, 1.0)
        policy.bind_timing(_timing(copy_s))
        slots = SlotMap(E, G, policy.capacity)
        first = policy.plan(0, np.array([10.0, 10.0, 10.0, 10.0]), None)
        slots.apply(first)
        skewed = np.array([200.0, 10.0, 10.0, 10.0])  # expert 0 turns hot: a new replica would halve its time
        placements[copy_s] = policy.plan(0, skewed, slots.live())
        saving = policy.timing.layer_s(first, skewed) - policy.timing.layer_s(placements[copy_s], skewed)
        if copy_s == 10.0:
            assert placements[copy_s].pairs() == first.pairs() and policy.kept == 1  # 64 x saving < 10 s of copying
        else:
            assert saving > 0 and placements[copy_s].pairs() != first.pairs() and policy.kept == 0
    # the copy a plan needs: peer where a device holds the expert, host memory otherwise
    live = Placement.from_lists(4, 2, [(0, 0), (1, 0), (2, 1), (3, 1)])
    cand = Placement.from_lists(4, 2, [(0, 0), (0, 1), (1, 0), (2, 1), (3, 1)])
    t = _timing(1.0)
    assert copy_seconds(cand, live, t) == pytest.approx(1.0) and copy_seconds(cand, live, t, peer_copies=False) == 2.0


def test_cost_aware_scaling_drops_replicas_that_only_add_weight_streaming():
    """At decode sizes a second replica reads the expert's weights again and saves little: not kept."""
    policy = MoElessPolicy.from_settings(MoElessSettings(cost_aware_scaling=True), 4, 2, 1.0)
    policy.bind_timing(_timing(1.0))
    small = policy.plan(0, np.array([4.0, 1.0, 1.0, 1.0]), None)
    assert small.num_replicas == 4  # the scaler's CV target alone would add replicas of expert 0
    literal = MoElessPolicy.from_settings(MoElessSettings(), 4, 2, 1.0).plan(0, np.array([4.0, 1.0, 1.0, 1.0]), None)
    assert literal.num_replicas > 4
    big = policy.plan(1, np.array([400.0, 10.0, 10.0, 10.0]), None)  # compute-bound: replication pays
    assert big.num_replicas > 4


def test_craft_knapsack_spends_the_budget_where_it_saves_most():
    # layer 0 gains 5 then 1 from its first two replicas; layer 1 gains 3 then 0
    times = np.array([[10.0, 5.0, 4.0], [10.0, 7.0, 7.0]])
    assert allocate(times, 1).tolist() == [1, 0]
    assert allocate(times, 2).tolist() == [1, 1]
    assert allocate(times, 4).tolist() == [2, 1]  # the useless replica of layer 1 is not taken
    assert CRAFTSettings(max_redundant_per_layer=8).slots_per_device(8, 8) == 2


def test_every_frontier_point_builds_from_the_serve_config():
    from omegaconf import OmegaConf

    from engine.serverless.experiments import FRONTIER, default_specs, frontier_systems
    from engine.serverless.policies import build_policy

    sv = OmegaConf.to_object(compose("serve").serverless)
    for E in (8, 16):
        specs = frontier_systems(default_specs(sv, E, 8), 8)
        assert [s.label for s in specs] == [label for label, _, _ in FRONTIER]
        for spec in specs:
            build_policy(spec, E, 8, 1.0)
        eplb2 = next(s for s in specs if s.label.startswith("EPLB +2"))
        assert eplb2.settings.num_redundant == 16
