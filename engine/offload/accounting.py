"""Layer accounting: what a MoE layer's plan does to the cache, the link queue and the metrics.

The real executor (`engine.offload.executor`) and the simulator (`engine.sim.pipeline`) tell one story
per MoE layer and differ only in the mechanism: real transfers, real CPU / device compute and wall-clock
times in the executor; modelled times from the cost model in the simulator. The story, in call order:

1. `settle_prefetches(dropped)`, at the plan point: the transfers of the previous plan that have not
   started are dropped (Premise 3); every prefetch of that plan that did start counts toward its target
   layer (a dropped one never moved, so it is neither used nor wasted);
2. `open_layer(state)`: the layer's active experts against those resident or landing (the cache hit
   rate), and the prefetches that started for this layer against the experts it uses (prefetch hits;
   the rest are wasted prefetches). It reads the state only, so it may follow 3 and 4 (the executor
   accounts it after the plan is issued, outside the plan point it times);
3. `plan(scheduler, state, validate)`: the scheduler's plan, checked against the contract;
4. `issue(layer, plan, residency)`: the plan's evictions applied to the residency in plan order, then
   the new link queue: the held prefetches of earlier plans (`plan.hold`, not dropped), this layer's
   on-demand loads in plan order, then the prefetches in plan order, each to its target layer;
5. `transfer(...)`: the link time, bytes and count of every transfer that moved, and its link event;
6. `close_layer(...)`: the layer's duration, its GPU and CPU busy time and its expert counts.

Events (busy intervals of the gpu / cpu / link lanes) are kept for the passes being recorded (timelines,
invariant checks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, NamedTuple, Protocol

import numpy as np

from engine.offload.metrics import RunMetrics
from schedulers.base import LayerPlan, LayerState, OffloadScheduler, Phase


@dataclass
class Event:
    """One busy interval of a lane, recorded for timelines and invariant checks."""

    lane: str  # "gpu" | "cpu" | "link"
    start: float
    end: float
    pass_index: int
    layer: int  # MoE layer (-1: dense layer / head)
    expert: int = -1  # -1: attention, dense MLP, head
    tokens: int = 0
    kind: str = ""  # gpu: attn | shared | expert | dense | head; link: ondemand (cached) | staged | prefetch


class QueuedTransfer(NamedTuple):
    """One transfer of a plan's link queue."""

    layer: int  # the MoE layer of the expert (a prefetch's target layer)
    expert: int
    retain: bool  # lands in the expert cache (False: a staging buffer, freed after its compute)
    prefetch: bool


class TransferLike(Protocol):
    """A mechanism's record of a transfer (the simulator's and the link's jobs, `QueuedTransfer`)."""

    layer: int
    expert: int
    retain: bool
    prefetch: bool


class Residency(Protocol):
    """The expert cache a plan's evictions apply to (`ResidencyTable`, the executor's `DeviceExpertCache`)."""

    def evict(self, layer: int, expert: int) -> None: ...


class ResidencyTable:
    """Which experts a modelled expert cache holds (the simulator's cache; the executor's is on the device)."""

    def __init__(self, initial: np.ndarray):
        self.mask = np.asarray(initial, dtype=bool).copy()  # bool [L, E]: landed in the cache
        self.count = int(self.mask.sum())

    def evict(self, layer: int, expert: int) -> None:
        self.mask[layer, expert] = False
        self.count -= 1

    def land(self, layer: int, expert: int) -> None:
        if not self.mask[layer, expert]:
            self.mask[layer, expert] = True
            self.count += 1

    def copy(self) -> "ResidencyTable":
        table = ResidencyTable(self.mask)
        table.count = self.count
        return table


def link_kind(transfer: TransferLike) -> str:
    """The link event kind of a transfer: prefetch, ondemand (cached after use) or staged."""
    if transfer.prefetch:
        return "prefetch"
    return "ondemand" if transfer.retain else "staged"


class LayerAccounting:
    """The per-layer bookkeeping of one offloaded run, real or simulated (see the module docstring)."""

    def __init__(self, num_layers: int, expert_bytes: int):
        self.num_layers = num_layers
        self.expert_bytes = expert_bytes
        self.metrics = RunMetrics(num_layers=num_layers)
        self.events: list[Event] = []
        self.pass_index = -1  # the pass events are recorded under
        self.recording = False  # keep the events of the current pass
        self._queued_prefetches: list[tuple[int, int]] = []  # (target, expert) of the latest plan, maybe unstarted
        self._prefetched: dict[int, set[int]] = {}  # target MoE layer -> experts whose prefetch started

    def new_run(self) -> None:
        """Fresh metrics and events (the prefetches on their way still count toward their targets)."""
        self.metrics = RunMetrics(num_layers=self.num_layers)
        self.events = []

    # ---- the layer's story -----------------------------------------------------------------------
    def settle_prefetches(self, dropped: Iterable[TransferLike]) -> None:
        """The plan point: the latest plan's prefetches not in `dropped` (transfers that never started) started."""
        never = {(job.layer, job.expert) for job in dropped if job.prefetch}
        for target, expert in self._queued_prefetches:
            if (target, expert) not in never:
                self._prefetched.setdefault(target, set()).add(expert)
        self._queued_prefetches = []

    def open_layer(self, state: LayerState) -> None:
        """Residency and prefetch outcome of layer `state.layer` at its gate."""
        active = state.active
        available = state.available(state.layer)
        self.metrics.add_residency(state.phase is Phase.prefill, len(active), int(available[active].sum()))
        prefetched = self._prefetched.pop(state.layer, None)
        if prefetched:
            used = sum(1 for expert in prefetched if state.tokens[expert] > 0)
            self.metrics.add_prefetch_outcome(used, len(prefetched))

    def plan(self, scheduler: OffloadScheduler, state: LayerState, validate: bool) -> LayerPlan:
        """The scheduler's plan; checked in full when `validate`, else only that it covers the active experts."""
        return self.check(scheduler, state, scheduler.plan(state), validate)

    def check(self, scheduler: OffloadScheduler, state: LayerState, plan: LayerPlan, validate: bool) -> LayerPlan:
        """`plan` (the scheduler's for `state`) checked as `plan` checks it: the executor times the call apart."""
        if not isinstance(plan, LayerPlan):
            raise TypeError(f"{scheduler.name}.plan returned {type(plan).__name__}, expected LayerPlan")
        if validate or len(plan.cpu) + len(plan.gpu) != len(state.active):
            plan.validate(state)  # raises with the reason
        return plan

    def issue(self, layer: int, plan: LayerPlan, residency: Residency) -> list[QueuedTransfer]:
        """Apply the plan's evictions, then return its link queue: held prefetches, on-demand loads, prefetches."""
        for evicted_layer, expert in plan.evict:
            residency.evict(evicted_layer, expert)
        queue = [QueuedTransfer(target, expert, True, True) for target, expert in plan.hold]
        queue += [QueuedTransfer(layer, expert, retain, False) for expert, retain in zip(plan.ondemand, plan.retain)]
        queue += [QueuedTransfer(target, expert, True, True) for target, expert in plan.prefetch]
        # a held prefetch of this layer started after its gate: this layer's hit rate already counted it as missing
        self._queued_prefetches = [item for item in plan.hold if item[0] > layer] + list(plan.prefetch)
        return queue

    def transfer(self, job: TransferLike, start: float, end: float, pass_index: int, record: bool) -> None:
        """A transfer that moved from `start` to `end` (issued in pass `pass_index`; `record`: keep its event)."""
        self.metrics.add_transfer(end - start, job.prefetch, self.expert_bytes)
        if record:
            self.events.append(Event("link", start, end, pass_index, job.layer, job.expert, kind=link_kind(job)))

    def close_layer(self, prefill: bool, layer: int, plan: LayerPlan, seconds: float, gpu_busy: float,
                    cpu_busy: float) -> None:
        """The layer is done: `seconds` from its start, the lanes' busy time, the plan's expert counts."""
        self.metrics.add_layer(prefill, layer, seconds, gpu_busy, cpu_busy, n_cpu=len(plan.cpu), n_gpu=len(plan.gpu),
                               n_ondemand=len(plan.ondemand), n_prefetch=len(plan.prefetch))

    def fused_passes(self, prefill: bool, passes: int, active: int) -> None:
        """Passes run as one device call over a full cache: their `active` experts were all resident."""
        self.metrics.add_residency(prefill, active, active)
        self.metrics.add_fused_passes(prefill, passes)

    # ---- events ----------------------------------------------------------------------------------
    def record(self, lane: str, start: float, end: float, layer: int, expert: int = -1, tokens: int = 0,
               kind: str = "") -> None:
        """A busy interval of the current pass (kept only while `recording`)."""
        if self.recording:
            self.events.append(Event(lane, start, end, self.pass_index, layer, expert, tokens, kind))

    # ---- search (the simulator's snapshot / restore) ----------------------------------------------
    def snapshot(self) -> tuple:
        return list(self._queued_prefetches), {target: set(experts) for target, experts in self._prefetched.items()}

    def restore(self, snap: tuple) -> None:
        queued, prefetched = snap
        self._queued_prefetches = list(queued)
        self._prefetched = {target: set(experts) for target, experts in prefetched.items()}
