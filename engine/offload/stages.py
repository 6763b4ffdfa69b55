"""Where a MoE layer's wall time goes in the offload executor: planning and the orchestration around the experts.

Every MoE layer is cut into laps as the executor runs it: `device_sync` (waiting for the device's attention and
gate to hand the routing over), `route` (the routing on the host: forecasts scored, the Counter, contexts),
`state` (the scheduler's `LayerState` built from the cache and the link), `plan` (the policy's `plan` call
alone: what issue 29 asks to report per policy), `issue` (evictions and the new link queue), `dispatch`
(device expert calls issued), `transfer_wait` (waiting for landing transfers), `cpu_experts` (CPU experts
computed or waited for), `device_compute` (waiting for the device's expert work), `bookkeeping` (metrics,
accounting, pins). The laps of a layer sum to its wall time from the gate's dispatch to its output, so the
executor's own cost is what is not device work, transfers or CPU experts.

Beside the laps, each layer's *exposed* planning time: the `plan` lap when the device had nothing left to run at the
plan's end (its queue empty: the plan was on the critical path), 0 when device work was still running then (the
plan was hidden behind it, as behind a layer's resident experts, or the next layer's attention when the plan runs
after it is dispatched: the executor's `plan_behind_device`). A plan during whose middle the device went idle counts
whole, so the figure is an upper bound.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import numpy as np

from schedulers.base import LayerPlan, Phase

STAGES = ("device_sync", "route", "state", "plan", "issue", "dispatch", "transfer_wait", "cpu_experts",
          "device_compute", "bookkeeping")
OWN = ("route", "state", "plan", "issue", "dispatch", "bookkeeping")  # host work of the executor and its policy


class LayerLaps:
    """One MoE layer's laps: each `lap(stage)` charges the time since the previous lap to `stage`."""

    def __init__(self, owner: "StageTimes", phase: Phase):
        self.owner, self.phase = owner, phase
        self.seconds: dict[str, float] = defaultdict(float)
        self.exposed = 0.0  # the plan's seconds on the critical path (module docstring)
        self.behind = False  # planned behind the next device call (`plan_behind_device`)
        self.last = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] += now - self.last
        self.last = now

    def plan_done(self, device_busy: bool) -> None:
        """Lap the plan; `device_busy`: device work was still running at its end (the plan was hidden)."""
        start = self.last
        self.lap("plan")
        if not device_busy:
            self.exposed += self.last - start

    def skip(self) -> None:
        """Charge nothing for the time since the last lap (spent outside the layer: the next device call's dispatch)."""
        self.last = time.perf_counter()

    def close(self, plan: LayerPlan) -> None:
        self.owner.add(self.phase, self.seconds, plan, self.exposed, self.behind)


class StageTimes:
    """Per-layer stage times of every MoE layer an executor ran, by phase; `summary` for results.json."""

    def __init__(self) -> None:
        self.layers: dict[Phase, list[dict[str, float]]] = {Phase.prefill: [], Phase.decode: []}
        self.cpu_experts: list[int] = []  # decode layers: experts the plan put on the CPU
        self.loads: list[int] = []  # decode layers: on-demand loads
        self.exposed: dict[Phase, list[float]] = {Phase.prefill: [], Phase.decode: []}  # plan seconds exposed
        self.behind: dict[Phase, list[bool]] = {Phase.prefill: [], Phase.decode: []}  # planned behind the device

    def laps(self, phase: Phase) -> LayerLaps:
        return LayerLaps(self, phase)

    def add(self, phase: Phase, seconds: dict[str, float], plan: LayerPlan, exposed: float = 0.0,
            behind: bool = False) -> None:
        self.layers[phase].append(dict(seconds))
        self.exposed[phase].append(exposed)
        self.behind[phase].append(behind)
        if phase is Phase.decode:
            self.cpu_experts.append(len(plan.cpu))
            self.loads.append(len(plan.ondemand))

    def clear(self) -> None:
        for rows in (*self.layers.values(), *self.exposed.values(), *self.behind.values()):
            rows.clear()
        self.cpu_experts.clear()
        self.loads.clear()

    def planning(self) -> dict[str, Any]:
        """The policy's `plan` call per MoE layer, in ms: median, p99, mean and count, per phase; of it the mean
        exposed (on the critical path, an upper bound: module docstring) and the share of layers planned behind
        the next device call."""
        out: dict[str, Any] = {}
        for phase, rows in self.layers.items():
            values = np.array([r.get("plan", 0.0) for r in rows]) * 1e3
            if len(values):
                exposed = 1e3 * np.asarray(self.exposed[phase])
                out[phase.value] = {"median_ms": float(np.median(values)), "p99_ms": float(np.percentile(values, 99)),
                                    "mean_ms": float(values.mean()), "layers": int(len(values)),
                                    "exposed_mean_ms": float(exposed.mean()),
                                    "exposed_share": float(exposed.sum() / values.sum()) if values.sum() else 0.0,
                                    "behind_device_share": float(np.mean(self.behind[phase]))}
        return out

    def decode_breakdown(self) -> dict[str, Any]:
        """Mean ms per decode MoE layer of every stage, their total, and the executor's own share (`OWN`)."""
        rows = self.layers[Phase.decode]
        if not rows:
            return {}
        mean = {stage: 1e3 * float(np.mean([r.get(stage, 0.0) for r in rows])) for stage in STAGES}
        total = sum(mean.values())
        own = sum(mean[s] for s in OWN)
        return {"per_layer_ms": mean, "layer_ms": total, "executor_own_ms": own,
                "executor_own_share": own / total if total else 0.0, "layers": len(rows),
                "cpu_experts_per_layer": float(np.mean(self.cpu_experts)),
                "loads_per_layer": float(np.mean(self.loads))}
