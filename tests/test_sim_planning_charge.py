"""The simulator's planning charge (`simulate.planning`): a policy's own plan time reaches the simulated step."""

from __future__ import annotations

import time

import numpy as np
import pytest

from conf import compose
from engine.sim.pipeline import PipelineSim, PlanningCharge, SimOptions
from engine.simulate import spec_from_config
from models.loading import resolve_model_config
from schedulers.base import LayerPlan, PlanningPrice, SchedulerSettings
from schedulers.cost import CostModel
from schedulers.hardware import load_hardware
from core.trace import DECODE, TraceMeta, TraceRecorder
from engine.sim.workload import forward_passes


class Scripted:
    """Fixed plans, one per MoE layer; `spin_s`: thread CPU seconds each plan call burns (a plan that costs)."""

    micro_batches = 1

    def __init__(self, residency: np.ndarray, plans: list[LayerPlan], on_device: bool, spin_s: float = 0.0):
        self.name, self.settings = "scripted", SchedulerSettings(kind="scripted")
        self.resident_on_device = on_device
        self._residency, self._plans, self._spin = residency, plans, spin_s

    def initial_residency(self) -> np.ndarray:
        return self._residency.copy()

    def plan(self, state) -> LayerPlan:
        self.searched = state.layer == 0  # layer 0's plan runs the optional search `search_us` charges
        end = time.thread_time() + self._spin
        while time.thread_time() < end:
            pass
        return self._plans[state.layer]


def two_layer_pass(charge: PlanningCharge, on_device: bool, spin_s: float = 0.0) -> tuple[float, CostModel]:
    """One decode pass of 2 MoE layers: layer 0 runs resident expert 0 and loads expert 1 on demand, layer 1 runs its
    resident experts 2 and 3."""
    cfg = resolve_model_config(compose("simulate", ["model=mixtral_8x7b"]).model).replace(num_hidden_layers=2)
    cost = CostModel(cfg, load_hardware("a100_pcie4"))
    meta = TraceMeta(model="t", num_experts=cfg.num_experts, top_k=2, moe_layers=cfg.moe_layers)
    rec = TraceRecorder(meta)
    rec.add_step([np.array([[0, 1]]), np.array([[2, 3]])], [np.full((1, 2), 0.5)] * 2, seq=np.array([0]),
                 pos=np.array([100]), phase=DECODE)
    trace = rec.build()
    resident = np.zeros((2, 8), dtype=bool)
    resident[0, 0] = resident[1, 2] = resident[1, 3] = True
    plans = [LayerPlan(gpu=(0, 1), ondemand=(1,)), LayerPlan(gpu=(2, 3))]
    sim = PipelineSim(cfg=cfg, cost=cost, scheduler=Scripted(resident, plans, on_device, spin_s), cache_slots=4,
                      staging_slots=2, trace=trace, options=SimOptions(planning=charge, check_invariants=True))
    return sim.run_pass(forward_passes(trace)[0]), cost


@pytest.mark.parametrize("on_device", [True, False])
def test_fixed_charge_reaches_the_step_by_hand(on_device: bool) -> None:
    c = 5e-3  # longer than layer 1's experts: planned behind the device or not makes a difference
    off, cost = two_layer_pass(PlanningCharge(), on_device)
    charged, _ = two_layer_pass(PlanningCharge("fixed", {"scripted": c * 1e6}), on_device)
    a, g, io, h = cost.t_attn(1, 101), cost.t_g(1), cost.t_io, cost.t_head(1)
    both = float(np.sum(cost.t_g_group(np.array([1, 1]))))  # layer 1's resident experts in one call
    assert io > g  # layer 0 ends with its load, whenever its resident expert runs
    # layer 0: the load starts when the plan ends, c after the gate; layer 1: its resident experts start at the gate
    # where the policy keeps resident experts on the device, and the layer is planned behind the device (all
    # resident): nothing waits for its plan; otherwise the experts and the layer's end wait for the plan
    assert off == pytest.approx(2 * a + io + g + both + h, rel=1e-12)
    assert charged == pytest.approx(off + (c if on_device else 2 * c), rel=1e-12)


def test_fixed_charge_adds_the_search_price_to_a_searched_plan() -> None:
    """`search_us.<kind>`: a plan that ran its search (layer 0's here) is charged that much more; the policy is told
    it as its price (`PlanningCharge.price`), and a measured charge's price is its clock."""
    charge = PlanningCharge("fixed", {"scripted": 100.0}, {"scripted": 400.0})
    plain, _ = two_layer_pass(PlanningCharge("fixed", {"scripted": 100.0}), True)
    searched, _ = two_layer_pass(charge, True)
    assert searched == pytest.approx(plain + 400e-6, rel=1e-12)  # layer 0's load waits 0.4 ms more
    assert charge.price("scripted").clock is None and charge.price("scripted").search_s == pytest.approx(400e-6)
    assert charge.price("horizon") == PlanningPrice() and PlanningCharge().price("scripted").free
    assert PlanningCharge("measured_cpu").price("scripted").clock is time.thread_time
    assert PlanningCharge("measured").price("scripted").clock is time.perf_counter
    with pytest.raises(ValueError, match="planning.search_us"):
        PlanningCharge("fixed", {"scripted": 1.0}, {"scripted": -1.0})


def test_measured_charge_counts_the_plan_call() -> None:
    spin = 2e-3  # thread CPU time: the host's other jobs do not make it shorter
    off, _ = two_layer_pass(PlanningCharge(), True, spin)
    charged, _ = two_layer_pass(PlanningCharge("measured_cpu"), True, spin)
    assert charged - off >= spin  # layer 0's plan delays its load (layer 1 is planned behind the device)


def test_planning_config_key() -> None:
    spec = spec_from_config(compose("simulate", ["planning.mode=fixed", "+planning.fixed_us.horizon=250"]))
    assert spec.planning == PlanningCharge("fixed", {"horizon": 250.0})
    assert spec_from_config(compose("simulate", [])).planning.mode == "off"
    with pytest.raises(ValueError, match="planning.mode"):
        spec_from_config(compose("simulate", ["planning.mode=sometimes"]))
    with pytest.raises(ValueError, match="planning.fixed_us has no entry for scheduler kind 'presched'"):
        PlanningCharge("fixed", {"horizon": 1.0}).fixed_s("presched")
