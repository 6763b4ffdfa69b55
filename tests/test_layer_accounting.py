"""The layer accounting both offload mechanisms share (engine.offload.accounting), driven by hand."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from engine.offload.accounting import LayerAccounting, QueuedTransfer, ResidencyTable
from schedulers.base import LayerPlan, LayerState, Phase, Transfer

LAYERS, EXPERTS, SLOTS = 3, 4, 4


def layer_state(layer: int, tokens: list[int], table: ResidencyTable, inflight: tuple[Transfer, ...] = (),
                phase: Phase = Phase.decode) -> LayerState:
    counts = np.asarray(tokens, np.int64)
    return LayerState(layer=layer, num_layers=LAYERS, phase=phase, tokens=counts, scores=counts.astype(float),
                      predicted={}, resident=table.mask.copy(), inflight=inflight, queued=(), alpha_s=0.0,
                      cache_slots=SLOTS, free_slots=SLOTS - table.count - sum(t.retain for t in inflight),
                      batch_tokens=int(counts.sum()), context_len=8, hit_rate={}, cost=None,  # type: ignore[arg-type]
                      t_io_s=1.0, t_attn_next_s=0.0)


class Scripted:
    name = "scripted"

    def __init__(self, plan: LayerPlan):
        self._plan = plan

    def plan(self, state: LayerState) -> LayerPlan:
        return self._plan


def test_a_hand_written_plan_moves_residency_queue_and_counters() -> None:
    initial = np.zeros((LAYERS, EXPERTS), bool)
    initial[0, 0] = initial[0, 1] = initial[2, 3] = True
    table = ResidencyTable(initial)
    acct = LayerAccounting(LAYERS, expert_bytes=100)
    acct.pass_index, acct.recording = 7, True

    # layer 0: experts 0, 1 resident, 3 loaded into a staging buffer; two prefetches after an eviction
    acct.settle_prefetches([])
    state = layer_state(0, [2, 1, 0, 1], table)
    acct.open_layer(state)
    plan = acct.plan(Scripted(LayerPlan(gpu=(0, 1, 3), ondemand=(3,), prefetch=((1, 2), (2, 0)), evict=((2, 3),))),
                     state, validate=True)
    queue = acct.issue(0, plan, table)
    assert queue == [QueuedTransfer(0, 3, False, False), QueuedTransfer(1, 2, True, True),
                     QueuedTransfer(2, 0, True, True)]  # on-demand loads first, each prefetch to its target layer
    assert not table.mask[2, 3] and table.count == 2  # the eviction applied
    metrics = acct.metrics
    assert (metrics.active_decode, metrics.available_decode) == (3, 2)
    acct.transfer(queue[0], 1.0, 2.0, acct.pass_index, record=True)  # the staged load moved
    acct.transfer(queue[1], 2.0, 3.0, acct.pass_index, record=True)  # the first prefetch started (and lands)
    table.land(1, 2)
    acct.close_layer(False, 0, plan, seconds=3.0, gpu_busy=2.0, cpu_busy=0.0)
    assert (metrics.n_ondemand[0], metrics.n_prefetch[0], metrics.n_gpu_experts[0]) == (1, 2, 3)
    assert (metrics.n_ondemand_transfers, metrics.n_prefetch_transfers, metrics.bytes_moved) == (1, 1, 200)
    assert [(e.lane, e.layer, e.expert, e.kind, e.pass_index) for e in acct.events] == [
        ("link", 0, 3, "staged", 7), ("link", 1, 2, "prefetch", 7)]

    # layer 1's plan point: the prefetch of (2, 0) never started; (1, 2) did and is used by layer 1
    acct.settle_prefetches([QueuedTransfer(2, 0, True, True)])
    state = layer_state(1, [0, 3, 1, 0], table)
    acct.open_layer(state)
    assert (metrics.prefetch_used, metrics.prefetch_issued) == (1, 1)
    assert (metrics.active_decode, metrics.available_decode) == (5, 3)  # expert 1 of layer 1 is a miss
    plan = acct.plan(Scripted(LayerPlan(cpu=(1,), gpu=(2,))), state, validate=True)
    assert acct.issue(1, plan, table) == []

    # layer 2: the dropped prefetch is neither used nor wasted; the evicted expert is a miss
    acct.settle_prefetches([])
    acct.open_layer(layer_state(2, [1, 0, 0, 1], table))
    assert (metrics.prefetch_used, metrics.prefetch_issued) == (1, 1)
    assert (metrics.active_decode, metrics.available_decode) == (7, 3)


def test_a_started_prefetch_its_layer_never_uses_is_wasted() -> None:
    table = ResidencyTable(np.zeros((LAYERS, EXPERTS), bool))
    acct = LayerAccounting(LAYERS, expert_bytes=1)
    acct.settle_prefetches([])
    state = layer_state(0, [1, 0, 0, 0], table, phase=Phase.prefill)
    acct.open_layer(state)
    plan = acct.plan(Scripted(LayerPlan(cpu=(0,), prefetch=((1, 1), (1, 2)))), state, validate=True)
    acct.issue(0, plan, table)
    acct.settle_prefetches([])  # both started
    acct.open_layer(layer_state(1, [0, 0, 4, 0], table, inflight=(Transfer(1, 1, 0.5), Transfer(1, 2, 0.2))))
    metrics = acct.metrics
    assert (metrics.prefetch_used, metrics.prefetch_issued) == (1, 2)
    assert (metrics.active_prefill, metrics.available_prefill) == (1, 0)
    assert (metrics.active_decode, metrics.available_decode) == (1, 1)  # landing counts as available


def test_a_plan_that_misses_an_active_expert_is_refused_even_unvalidated() -> None:
    table = ResidencyTable(np.ones((LAYERS, EXPERTS), bool))
    acct = LayerAccounting(LAYERS, expert_bytes=1)
    state = layer_state(0, [1, 1, 0, 0], table)
    with pytest.raises(ValueError, match="layer 0: plan covers"):
        acct.plan(Scripted(LayerPlan(gpu=(0,))), state, validate=False)
    with pytest.raises(TypeError, match="expected LayerPlan"):
        acct.plan(Scripted("gpu only"), state, validate=False)  # type: ignore[arg-type]


def test_the_executor_imports_nothing_from_the_simulator() -> None:
    code = ("import sys, engine.offload.executor; "
            "print(sorted(m for m in sys.modules if m == 'engine.sim' or m.startswith('engine.sim.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
