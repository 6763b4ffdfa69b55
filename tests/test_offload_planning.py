"""Planning behind the device (`OffloadSettings.plan_behind_device`): a layer whose active experts are all resident is
planned after the next device call is dispatched, and it makes the very plans, in the same order, that planning
before the layer's output makes; the exposed planning time is reported per phase."""

from __future__ import annotations

import numpy as np
import pytest

from conf import compose
from engine.offload.executor import OffloadExecutor, OffloadSettings
from engine.offload.store import ExpertStore
from models.loading import load_model
from predictors.gate import GatePredictor
from schedulers.base import OFFLOAD, LayerPlan, LayerState, SchedulerSetup, build_scheduler
from schedulers.cost import CostModel
from schedulers.hardware import load_hardware
from tests.test_offload_executor import CheckedScheduler


class RecordedScheduler(CheckedScheduler):
    """The cache-checking wrapper that also keeps every (MoE layer, plan) it returns, in call order."""

    def __init__(self, inner, slots: int):
        super().__init__(inner, slots)
        self.recorded: list[tuple[int, LayerPlan]] = []

    def plan(self, state: LayerState) -> LayerPlan:
        plan = super().plan(state)
        self.recorded.append((state.layer, plan))
        return plan


def _serve(model, store, cfg, prompts, behind: bool, kind: str = "horizon", new: int = 6):
    """Tokens, recorded plans and planning summary of one run on a synchronous link with the cost model as
    calibrated (nothing in the plans' inputs depends on timing)."""
    L, E = len(cfg.moe_layers), cfg.num_experts
    cost = CostModel(cfg, load_hardware("local_cpu"))
    profile = np.arange(L * E).reshape(L, E) % 7
    slots = L * E // 2  # half the experts: some decode layers have all their active experts resident, some not
    inner = build_scheduler(OFFLOAD.get(kind).settings(label=kind, use_predictor=True), SchedulerSetup(L, E, cfg.num_experts_per_tok, slots,
                                                                                    cost, profile))
    sched = RecordedScheduler(inner, slots)
    mech = OffloadSettings(cache_slots=slots, async_io=False, timer_updates_cost=False, plan_behind_device=behind)
    gate = {d: GatePredictor.from_model(model, d) for d in (1, 2)}  # forecasts, so that plans prefetch
    with OffloadExecutor(model, store, sched, cost, mech, gate) as ex:
        out = ex.generate(prompts, new)
        planning = ex.stages.planning()
    return out, sched.recorded, planning


@pytest.mark.slow  # two served runs, ~35 s on a loaded 2-core machine
def test_plans_behind_the_device_are_the_plans_made_before_it() -> None:
    cfg, model, _ = load_model(compose("generate", ["model=mixtral_tiny"]).model, seed=0)
    store = ExpertStore.from_model(model)
    rs = np.random.RandomState(0)  # the prompts of tests/test_offload_executor.py: its compiled shapes are reused
    prompts = [rs.randint(3, cfg.vocab_size, n).tolist() for n in (6, 11, 3)]
    before, plans_before, planning_before = _serve(model, store, cfg, prompts, behind=False)
    behind, plans_behind, planning_behind = _serve(model, store, cfg, prompts, behind=True)
    # (the tokens of planning before the output are the in-memory model's: tests/test_offload_executor.py)
    assert np.array_equal(before.tokens, behind.tokens)
    assert plans_behind == plans_before and len(plans_before) > 0
    decode = planning_behind["decode"]
    # some layers had every active expert resident (planned behind the device), some did not
    assert 0 < decode["behind_device_share"] < 1, decode
    assert planning_before["decode"]["behind_device_share"] == 0
    assert 0 <= decode["exposed_mean_ms"] <= decode["mean_ms"]
