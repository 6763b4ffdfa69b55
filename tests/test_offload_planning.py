"""Planning behind the device (`OffloadSettings.plan_behind_device`): a layer whose active experts are all resident is
planned after the next device call is dispatched, and it makes the very plans, in the same order, that planning
before the layer's output makes; the exposed planning time is reported per phase."""

from __future__ import annotations

import numpy as np

from conf import compose
from engine.offload.executor import OffloadExecutor, OffloadSettings
from engine.offload.store import ExpertStore
from models.generation import Generator
from models.loading import load_model
from schedulers.base import OFFLOAD, LayerPlan, LayerState, SchedulerSetup, build_scheduler
from schedulers.cost import CostModel
from schedulers.hardware import load_hardware


class RecordedScheduler:
    """Delegates to a real scheduler and keeps every (MoE layer, plan) it returns, in call order."""

    def __init__(self, inner):
        self.inner, self.name, self.settings = inner, inner.name, inner.settings
        self.plans: list[tuple[int, LayerPlan]] = []

    @property
    def micro_batches(self) -> int:
        return self.inner.micro_batches

    @property
    def resident_on_device(self) -> bool:
        return self.inner.resident_on_device

    def initial_residency(self):
        return self.inner.initial_residency()

    def plan(self, state: LayerState) -> LayerPlan:
        plan = self.inner.plan(state)
        self.plans.append((state.layer, plan))
        return plan


def _serve(model, store, cfg, prompts, behind: bool, kind: str = "horizon", new: int = 5):
    """Tokens, recorded plans and planning summary of one run on a synchronous link with the cost model as
    calibrated (nothing in the plans' inputs depends on timing)."""
    L, E = len(cfg.moe_layers), cfg.num_experts
    cost = CostModel(cfg, load_hardware("local_cpu"))
    profile = np.arange(L * E).reshape(L, E) % 7
    slots = L * E // 4
    inner = build_scheduler(OFFLOAD.get(kind).settings(label=kind), SchedulerSetup(L, E, cfg.num_experts_per_tok, slots,
                                                                                    cost, profile))
    sched = RecordedScheduler(inner)
    mech = OffloadSettings(cache_slots=slots, async_io=False, timer_updates_cost=False, plan_behind_device=behind)
    with OffloadExecutor(model, store, sched, cost, mech) as ex:
        out = ex.generate(prompts, new)
        planning = ex.stages.planning()
    return out, sched.plans, planning


def test_plans_behind_the_device_are_the_plans_made_before_it() -> None:
    cfg, model, _ = load_model(compose("generate", ["model=mixtral_tiny"]).model, seed=0)
    store = ExpertStore.from_model(model)
    rs = np.random.RandomState(1)
    prompts = [rs.randint(3, cfg.vocab_size, n).tolist() for n in (5, 9)]
    ref = Generator(model).generate(prompts, 5)
    before, plans_before, planning_before = _serve(model, store, cfg, prompts, behind=False)
    behind, plans_behind, planning_behind = _serve(model, store, cfg, prompts, behind=True)
    assert np.array_equal(before.tokens, ref.tokens) and np.array_equal(behind.tokens, ref.tokens)
    assert plans_behind == plans_before and len(plans_before) > 0
    decode = planning_behind["decode"]
    # some layers had every active expert resident (planned behind the device), some did not
    assert 0 < decode["behind_device_share"] < 1, decode
    assert planning_before["decode"]["behind_device_share"] == 0
    assert 0 <= decode["exposed_mean_ms"] <= decode["mean_ms"]
