"""Device expert cache (LayerScope §4.4): fixed, preallocated slots overwritten in place.

Slots are allocated once, at start, from a memory budget: `cache_slots` for the expert cache (the
hot-expert table and prefetches) and `staging_slots` on-demand buffers that alternate between
computing and loading. A transfer writes into its slot with a donated jitted update, so no device
memory is allocated per transfer. The residency table maps (MoE layer, expert) to its slot. A slot
that a computation is using is pinned: writing into it is an error, never a silent overwrite.

Quantized slots are budgeted at the widest layer's row bytes (a Q4_K_M file's Q6_K down rows) but hold each
expert at its own layer's row bytes: a transfer into a slot last holding a layer of other block types gives it
arrays of the new width first. The expert kernels then read every slot as it is; a slot wider than its expert
would be cut to the expert's rows inside every expert call, a copy of all E operands per call (at
Qwen3-30B-A3B width 128 x 0.88 MB = 113 MB, made and freed per Q4_K layer: host memory that fragmented the
allocator's arenas over a run on the CPU backend).
"""

from __future__ import annotations

import enum
import functools
import threading
from dataclasses import dataclass
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from models.config import ModelConfig


class SlotState(enum.Enum):
    free = "free"
    loading = "loading"  # reserved by a transfer that has not landed
    resident = "resident"


class CacheError(RuntimeError):
    """A cache operation that would break an invariant (overwrite in use, over budget, unknown expert)."""


@dataclass
class Slot:
    index: int
    staging: bool
    state: SlotState = SlotState.free
    owner: Optional[tuple[int, int]] = None  # (MoE layer, expert)
    pins: int = 0  # computations using the slot


def _write_rows(dst: jax.Array, src: jax.Array, row: int, at: int, rows: int,
                sharding: SingleDeviceSharding) -> jax.Array:
    """dst[at:at+rows] = src[row:row+rows] from a page-locked host array; jitted with dst donated (in place)."""
    chunk = jax.lax.dynamic_slice(src, (row, 0), (rows, src.shape[1]))
    chunk = jax.device_put(chunk, sharding).astype(dst.dtype)  # host (pinned) -> device inside the program
    return jax.lax.dynamic_update_slice(dst, chunk, (at, 0))


def _as_bits(x: jax.Array) -> jax.Array:
    """`x` reinterpreted as unsigned integers of its width (bf16 -> uint16): the same bytes, no conversion."""
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


def _write_block(dst: jax.Array, block: jax.Array, at: jax.Array) -> jax.Array:
    """dst[at:at+len(block)] = block (a host block already sliced); jitted with dst donated (in place).

    A block already in the slot's dtype is copied as unsigned integers of its width: XLA:CPU's update of a bf16
    array runs 1.7-2x slower than the same bytes as uint16 (engine/bench/bench_transfer.py); on a GPU the
    bitcast is free."""
    if block.dtype != dst.dtype:
        return jax.lax.dynamic_update_slice(dst, block.astype(dst.dtype), (at, jnp.int32(0)))
    out = jax.lax.dynamic_update_slice(_as_bits(dst), _as_bits(block), (at, jnp.int32(0)))
    return jax.lax.bitcast_convert_type(out, dst.dtype)


def slots_for_budget(budget_bytes: Optional[float], budget_experts: Optional[int], expert_bytes: int,
                     staging_slots: int, total_experts: int) -> int:
    """Expert-cache slots a budget buys after the staging buffers (at most every expert once)."""
    if (budget_bytes is None) == (budget_experts is None):
        raise ValueError("offload.budget: set exactly one of budget_bytes / budget_experts")
    experts = budget_experts if budget_experts is not None else int(budget_bytes // expert_bytes)
    slots = experts - staging_slots
    if slots < 0:
        raise ValueError(f"offload.budget: {experts} experts' worth of memory cannot hold the {staging_slots} "
                         f"on-demand staging buffers (one expert is {expert_bytes / 2**20:.2f} MiB)")
    return min(slots, total_experts)


class DeviceExpertCache:
    """`cache_slots + staging_slots` expert slots on one device, each gate|up rows [2F, H] and down [H, F]."""

    def __init__(self, cfg: ModelConfig, cache_slots: int, staging_slots: int = 2, dtype: Any = jnp.float32,
                 device: Optional[jax.Device] = None, block_widths: Optional[tuple[int, int]] = None):
        """`block_widths`: quantized experts' slots, uint8 gate|up [2F, widths[0]] and down [H, widths[1]] (row
        bytes wide enough for every layer's block types; a layer's expert fills the first row bytes)."""
        if staging_slots < 1:
            raise ValueError("offload.staging_slots: on-demand loads need at least one staging buffer")
        self.cfg = cfg
        self.device = device or jax.devices()[0]
        self.sharding = SingleDeviceSharding(self.device, memory_kind="device") \
            if "device" in {m.kind for m in self.device.addressable_memories()} else SingleDeviceSharding(self.device)
        self._write_rows = jax.jit(functools.partial(_write_rows, sharding=self.sharding), donate_argnums=0,
                                   static_argnums=(2, 3, 4))
        self._write_block = jax.jit(_write_block, donate_argnums=0)
        self._blank = jax.jit(jnp.zeros, static_argnums=(0, 1), out_shardings=self.sharding)
        self.block_widths = block_widths
        H, F = cfg.hidden_size, cfg.expert_intermediate_size
        self.num_layers, self.num_experts = len(cfg.moe_layers), cfg.num_experts
        n = cache_slots + staging_slots
        self.slots = [Slot(i, staging=i >= cache_slots) for i in range(n)]
        gu_shape, down_shape = ((2 * F, H), (H, F)) if block_widths is None else ((2 * F, block_widths[0]),
                                                                                  (H, block_widths[1]))
        dtype = dtype if block_widths is None else jnp.uint8
        self.gate_up = [jax.device_put(jnp.zeros(gu_shape, dtype), self.sharding) for _ in range(n)]
        self.down = [jax.device_put(jnp.zeros(down_shape, dtype), self.sharding) for _ in range(n)]
        self._where: dict[tuple[int, int], int] = {}
        # bool [L, E]: experts landed in a cache (non-staging) slot, kept as slots land and are freed (every plan
        # reads it: a scan of the slots took 0.31 ms of CPU per MoE layer at Qwen3-30B-A3B depth and budget 0.25,
        # 1538 slots; the kept mask 0.002 ms)
        self._resident = np.zeros((self.num_layers, self.num_experts), bool)
        self._lock = threading.RLock()
        self._freed = threading.Condition(self._lock)
        self.bytes_per_slot = (3 * H * F * jnp.dtype(dtype).itemsize if block_widths is None
                               else 2 * F * block_widths[0] + H * block_widths[1])

    # ---- inspection --------------------------------------------------------------------------------
    @property
    def cache_slots(self) -> int:
        return sum(not s.staging for s in self.slots)

    @property
    def device_bytes(self) -> int:
        return len(self.slots) * self.bytes_per_slot

    def slot_of(self, layer: int, expert: int) -> Optional[int]:
        with self._lock:
            return self._where.get((layer, expert))

    def resident_mask(self) -> np.ndarray:
        """bool [L, E]: experts whose weights have landed in a cache (non-staging) slot."""
        with self._lock:
            return self._resident.copy()

    def is_resident(self, layer: int, expert: int) -> bool:
        with self._lock:
            i = self._where.get((layer, expert))
            return i is not None and self.slots[i].state is SlotState.resident

    def free_cache_slots(self) -> int:
        with self._lock:
            return sum(1 for s in self.slots if not s.staging and s.state is SlotState.free)

    def reset(self) -> None:
        """Every slot free again (its arrays kept): a new run starts with an empty cache."""
        with self._lock:
            for s in self.slots:
                if s.pins:
                    raise CacheError(f"slot {s.index} ({s.owner}) is in use by a computation; cannot reset the cache")
                s.state, s.owner = SlotState.free, None
            self._where.clear()
            self._resident[:] = False
            self._freed.notify_all()

    def free(self) -> None:
        """Drop every slot's device arrays (the cache is unusable afterwards)."""
        with self._lock:
            if any(s.pins for s in self.slots):
                raise CacheError("cannot free the cache while a computation uses a slot")
            self.gate_up, self.down, self._where = [], [], {}
            self.slots = []
            self._resident[:] = False

    def arrays(self) -> tuple[list[jax.Array], list[jax.Array]]:
        """Current handles of every slot (for a computation that indexes slots)."""
        with self._lock:
            return list(self.gate_up), list(self.down)

    # ---- slot life cycle ------------------------------------------------------------------------------
    def reserve(self, layer: int, expert: int, staging: bool) -> int:
        """Take a free slot (a staging buffer or a cache slot) for a transfer of (layer, expert)."""
        with self._lock:
            if (layer, expert) in self._where:
                raise CacheError(f"expert ({layer}, {expert}) already has slot {self._where[(layer, expert)]}")
            for s in self.slots:
                if s.staging == staging and s.state is SlotState.free and s.pins == 0:
                    s.state, s.owner = SlotState.loading, (layer, expert)
                    self._where[(layer, expert)] = s.index
                    return s.index
        kind = "staging buffer" if staging else "cache slot"
        raise CacheError(f"no free {kind} for expert ({layer}, {expert}) (cache over budget)")

    def reserve_when_free(self, layer: int, expert: int, staging: bool, timeout: float = 600.0) -> int:
        """`reserve`, waiting for a slot of the kind to be released (the staging double buffer)."""
        with self._freed:
            ok = self._freed.wait_for(lambda: any(s.staging == staging and s.state is SlotState.free and s.pins == 0
                                                   for s in self.slots), timeout)
            if not ok:
                raise CacheError(f"no {'staging buffer' if staging else 'cache slot'} freed within {timeout} s "
                                 f"for expert ({layer}, {expert})")
            return self.reserve(layer, expert, staging)

    def write(self, slot: int, part: str, src: Any, row: int, rows: int) -> jax.Array:
        """Dispatch the in-place write of rows [row, row+rows) of one projection (`gate`, `up` [F, H] or `down`
        [H, F]) into `slot`. A numpy source (a mapped file on the CPU backend) is sliced on the host and the
        block copied; a page-locked jax source is sliced inside the program (one DMA per block)."""
        F = self.cfg.expert_intermediate_size
        with self._lock:
            s = self.slots[slot]
            if s.pins:
                raise CacheError(f"slot {slot} ({s.owner}) is in use by a computation; refusing to overwrite it")
            if s.state is not SlotState.loading:
                raise CacheError(f"slot {slot} is {s.state.value}, not reserved for a transfer")
            target = self.down if part == "down" else self.gate_up
            self._fit(target, slot, src.shape[1], part == "down")
            at = row + (F if part == "up" else 0)
            if isinstance(src, np.ndarray):
                block = jax.device_put(src[row:row + rows], self.sharding)
                target[slot] = out = self._write_block(target[slot], block, np.int32(at))
            else:
                target[slot] = out = self._write_rows(target[slot], src, row, at, rows)
            return out

    def _fit(self, target: list[jax.Array], slot: int, width: int, down: bool) -> None:
        """A quantized slot's array (`target[slot]`) at `width` row bytes, the layer being loaded's: new arrays
        where the slot last held a layer of other block types (its bytes are all written by the transfer)."""
        have = target[slot]
        if self.block_widths is None or have.shape[1] == width:
            return
        if width > self.block_widths[int(down)]:
            raise CacheError(f"slot {slot}: {'down' if down else 'gate|up'} rows of {width} bytes exceed the slot's "
                             f"budget of {self.block_widths[int(down)]}")
        target[slot] = self._blank((have.shape[0], width), have.dtype)

    def slot_shapes(self, widths: Optional[tuple[int, int]] = None) -> tuple[tuple[int, int], tuple[int, int]]:
        """Shapes of a slot's (gate|up, down) arrays holding an expert of row bytes `widths` (None: float slots, or
        quantized ones at the budgeted widths)."""
        H, F = self.cfg.hidden_size, self.cfg.expert_intermediate_size
        if self.block_widths is None:
            return (2 * F, H), (H, F)
        gu, dn = widths if widths is not None else self.block_widths
        return (2 * F, gu), (H, dn)

    def held_bytes(self) -> int:
        """Bytes the slots hold now (at most `device_bytes`: quantized slots at their experts' own widths)."""
        with self._lock:
            return sum(a.nbytes for a in self.gate_up + self.down)

    def land(self, slot: int) -> None:
        with self._lock:
            s = self.slots[slot]
            if s.state is not SlotState.loading:
                raise CacheError(f"slot {slot} landed while {s.state.value}")
            s.state = SlotState.resident
            if not s.staging and s.owner is not None:
                self._resident[s.owner] = True

    def release(self, slot: int) -> None:
        """Free a slot (eviction, a staging buffer after its compute, a cancelled or failed transfer)."""
        with self._lock:
            s = self.slots[slot]
            if s.pins:
                raise CacheError(f"slot {slot} ({s.owner}) is in use by a computation; cannot free it")
            if s.owner is not None:
                self._where.pop(s.owner, None)
                self._resident[s.owner] = False
            s.state, s.owner = SlotState.free, None
            self._freed.notify_all()

    def evict(self, layer: int, expert: int) -> None:
        slot = self.slot_of(layer, expert)
        if slot is None or self.slots[slot].state is not SlotState.resident:
            raise CacheError(f"evict ({layer}, {expert}): not resident")
        self.release(slot)

    def pin(self, slots: list[int]) -> None:
        with self._lock:
            for i in slots:
                if self.slots[i].state is not SlotState.resident:
                    raise CacheError(f"slot {i} is {self.slots[i].state.value}; only landed experts compute")
                self.slots[i].pins += 1

    def unpin(self, slots: list[int]) -> None:
        with self._lock:
            for i in slots:
                self.slots[i].pins -= 1
