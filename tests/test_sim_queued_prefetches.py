"""Non-droppable queued prefetches (`LayerPlan.hold`, `scheduler=layerwise keep_queued_prefetches=true`): a
prefetch not started by the next plan point keeps the head of the link and that layer's on-demand load waits
behind it; without the hold the mechanism drops it and the load goes first."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from engine.sim.invariants import check_events
from engine.sim.pipeline import PipelineSim, SimOptions
from schedulers.base import LayerPlan, LayerState, Phase, SchedulerSetup, Transfer
from schedulers.cost import CostModel
from schedulers.hardware import load_hardware
from schedulers.offload.layerwise import LayerwiseGreedy, LayerwiseSettings
from tests.test_simulator import ListPolicy, mixtral, one_decode_pass


def three_layer_run(hold: bool) -> tuple[PipelineSim, CostModel, list]:
    """Layer 0 loads expert 1 and prefetches (2, 4), (2, 5); a Mixtral copy (~27 ms) outlasts the layer, so at
    layer 1's gate (2, 4) is moving and (2, 5) is queued. Layer 1 loads expert 6, holding (2, 5) or not."""
    cfg = mixtral(3)
    cost = CostModel(cfg, load_hardware("v100_pcie3"))
    trace, passes = one_decode_pass(cfg, [[0, 1], [3, 6], [0, 4]])
    resident = np.zeros((3, 8), dtype=bool)
    resident[0, 0] = resident[1, 3] = resident[2, 0] = True
    plans = [LayerPlan(gpu=(0, 1), ondemand=(1,), prefetch=((2, 4), (2, 5))),
             LayerPlan(gpu=(3, 6), ondemand=(6,), hold=((2, 5),) if hold else ()),
             LayerPlan(gpu=(0, 4))]
    sim = PipelineSim(cfg=cfg, cost=cost, scheduler=ListPolicy(resident, plans), cache_slots=6, staging_slots=2,
                      trace=trace, options=SimOptions(check_invariants=True, record=True))
    sim.run(passes)
    check_events(sim.events, passes, staging_slots=2)
    return sim, cost, passes


def link_start(sim: PipelineSim, layer: int, expert: int) -> float:
    return next(e.start for e in sim.events if e.lane == "link" and (e.layer, e.expert) == (layer, expert))


def test_an_ondemand_load_waits_behind_a_held_prefetch_and_not_without() -> None:
    dropped, cost, _ = three_layer_run(hold=False)
    held, _, _ = three_layer_run(hold=True)
    assert not any(e.lane == "link" and (e.layer, e.expert) == (2, 5) for e in dropped.events)  # dropped: never moved
    # without the hold the load follows the prefetch that had started; with it, the held one goes first
    assert link_start(dropped, 1, 6) == pytest.approx(link_start(dropped, 2, 4) + cost.t_io, rel=1e-9)
    assert link_start(held, 2, 5) == pytest.approx(link_start(held, 2, 4) + cost.t_io, rel=1e-9)
    assert link_start(held, 1, 6) == pytest.approx(link_start(held, 2, 5) + cost.t_io, rel=1e-9)
    assert held.now > dropped.now + 0.9 * cost.t_io  # the layer waited for the whole held copy
    assert held.resident[2, 5]  # and the held prefetch landed in the cache


@pytest.mark.parametrize("keep", [False, True])
def test_layerwise_holds_its_queued_prefetches_only_when_asked(keep: bool) -> None:
    cfg = mixtral(3)
    cost = CostModel(cfg, load_hardware("v100_pcie3"))
    settings = replace(LayerwiseSettings(), keep_queued_prefetches=keep)
    policy = LayerwiseGreedy(settings, SchedulerSetup(num_layers=3, num_experts=8, top_k=2, cache_slots=6, cost=cost))
    resident = np.zeros((3, 8), dtype=bool)
    resident[1, 3] = True
    tokens = np.zeros(8, dtype=np.int64)
    tokens[[3, 6]] = 1
    state = LayerState(layer=1, num_layers=3, phase=Phase.decode, tokens=tokens, scores=tokens * 0.5, predicted={},
                       resident=resident, inflight=(Transfer(2, 4, 0.01),), queued=(Transfer(1, 6), Transfer(2, 5)),
                       alpha_s=0.01, cache_slots=6, free_slots=4, batch_tokens=1, context_len=100, hit_rate={},
                       cost=cost, t_io_s=cost.t_io, t_attn_next_s=cost.t_attn(1, 100))
    plan = policy.plan(state)
    plan.validate(state)
    assert plan.hold == (((1, 6), (2, 5)) if keep else ())
    if keep:  # expert 6 comes with its held prefetch: computed on the GPU, not loaded again
        assert 6 in plan.gpu and 6 not in plan.ondemand
