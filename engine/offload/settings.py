"""`OffloadSettings`: the `offload` config block of `python -m engine.run` and what the offload executor runs
with. One type: the entry point fills `cache_slots` from the budget (`engine.run.cache_slots`) and hands the
same object to the executor; `conf/schemas/run.py` composes it into the task's schema."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class OffloadSettings:
    """The expert memory budget (at most one of budget_fraction / budget_experts / budget_bytes; none: a quarter
    of the experts, capped at half the device memory the dense weights leave) and the mechanism's knobs."""

    # expert-cache capacity in experts, staging buffers not included; None: sized from the budget by engine.run
    cache_slots: Optional[int] = None
    budget_fraction: Optional[float] = None  # of all routed experts, staging buffers included
    budget_experts: Optional[int] = None
    budget_bytes: Optional[float] = None
    staging_slots: int = 2  # the on-demand double buffer
    chunks: int = 2  # row chunks per projection transfer (AsyncIO sub-transfers: 3 projections x chunks)
    async_io: bool = True  # False: synchronous copies (LayerScope ablation "no AsyncIO")
    cpu_threads: int = 1  # host threads of the CPU experts (they compute in the weights' own dtype)
    retries: int = 2  # attempts after a failed transfer before it surfaces
    validate_plans: bool = True  # check every plan against the scheduler contract
    timeline_passes: int = 32  # record lane events of the prefill and the first N decode passes (timeline plots)
    # a pass with every routed expert resident, nothing on the link and a scheduler that would plan device
    # work only runs as one device call (no gate to stop at: there is nothing to decide); False: layer by layer
    fuse_resident: bool = True
    # a layer whose active experts are all resident (and a scheduler that keeps resident experts on the device) is
    # planned after the next device call (its residual, the next layer's attention and gate) is dispatched: the plan
    # then decides only later layers' transfers, and runs behind the device instead of before it. False: every
    # plan before its layer's output (the same plans, earlier)
    plan_behind_device: bool = True
    # the Timer feeds measured costs back into the cost model (LayerScope §4.1); False: the plans see the cost model as
    # calibrated, so that two runs on a synchronous link make the same plans (the plan-order comparisons)
    timer_updates_cost: bool = True
    # host blocks of at least this many KiB get their own mapping, returned to the system when freed (glibc;
    # `engine.offload.host_alloc`): on the CPU backend the expert slots and every program's buffers are host memory,
    # and blocks of about a megabyte freed inside the allocator's arenas made a run's memory climb. 768 KiB maps a
    # Qwen3-30B-A3B slot's arrays (0.88-1.77 MB, made anew when a slot changes block widths) and leaves the
    # transfers' blocks (<= 0.65 MB, made and freed per expert at a few sizes) in the arenas: at full depth b8, flat
    # (+0 / -9 MB over the measured batch) at ~1.5x the decode rate of 256 KiB, which maps those too (flat, 0.15 GB
    # lower); 1 MiB grew by up to 130 MB. README "Full-depth quantized models". null: the allocator's default
    host_mmap_threshold_kib: Optional[int] = 768

    def slots(self) -> int:
        """`cache_slots`, which must have been sized by now."""
        if self.cache_slots is None:
            raise ValueError("offload.cache_slots: not sized; engine.run derives it from offload.budget_*")
        return int(self.cache_slots)
