"""Which replica sits in which slot of which device, and what a new placement has to move.

Bookkeeping shared by the real replica store and the simulator (numpy only). Each device offers S
slots per MoE layer. Applying a placement:

- a replica of expert e placed on device g reuses a slot of g that already holds e (a warm start:
  nothing moves);
- otherwise it takes a free slot of g (an empty one first, else the least recently used slot the
  new placement does not need) and its weights come from a peer device that holds e right now
  (device-to-device copy) or, if none does, from host memory;
- slots the new placement does not use keep their expert alive (serverless keep-alive): a later
  placement may warm-start from them until they are overwritten.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from schedulers.ep_placement import Placement

EMPTY = -1


class Source(enum.Enum):
    warm = "warm"  # already in the slot
    peer = "peer"  # copied from another device holding the expert
    host = "host"  # copied from the host master copy


@dataclass(frozen=True)
class Move:
    device: int
    slot: int
    expert: int
    source: Source
    src_device: int = -1  # peer moves: the device copied from


@dataclass
class SlotUpdate:
    """The slot each replica of a placement occupies (int64 [R]) and the weight copies needed."""

    slot_of_replica: np.ndarray
    moves: list[Move] = field(default_factory=list)

    def count(self, source: Source) -> int:
        return sum(1 for m in self.moves if m.source is source)


class SlotMap:
    """The slots of one MoE layer on G devices."""

    def __init__(self, num_experts: int, num_devices: int, slots_per_device: int):
        if slots_per_device < 1:
            raise ValueError(f"slots_per_device must be >= 1, got {slots_per_device}")
        self.num_experts = num_experts
        self.num_devices = num_devices
        self.slots = slots_per_device
        self.expert = np.full((num_devices, slots_per_device), EMPTY, dtype=np.int64)
        self.last_used = np.full((num_devices, slots_per_device), -1, dtype=np.int64)
        self._clock = 0
        self._live: Placement | None = None

    def live(self) -> Placement | None:
        """Every expert alive in a slot (kept-alive ones included); None while all slots are empty."""
        if self._live is None:
            g, s = np.nonzero(self.expert != EMPTY)
            if g.size == 0:
                return None
            self._live = Placement(self.num_experts, self.num_devices, self.expert[g, s], g)
        return self._live

    def resident_replicas(self) -> int:
        return int((self.expert != EMPTY).sum())

    def apply(self, placement: Placement) -> SlotUpdate:
        """Assign every replica of `placement` a slot; return the slots and the copies to make."""
        if placement.num_devices != self.num_devices or placement.num_experts != self.num_experts:
            raise ValueError(f"slot map: placement for {placement.num_experts} experts / {placement.num_devices} "
                             f"devices, map has {self.num_experts} / {self.num_devices}")
        placement.check_capacity(self.slots)
        self._clock += 1
        self._live = None
        table = self.expert.tolist()  # [G][S]; plain lists: this runs per layer per iteration
        slots_of: dict[tuple[int, int], list[int]] = {}  # (device, expert) -> unclaimed slots holding it
        for g, row in enumerate(table):
            for i, e in enumerate(row):
                if e != EMPTY:
                    slots_of.setdefault((g, e), []).append(i)
        holders: dict[int, list[int]] = {}  # expert -> devices holding it before this update
        for g, e in slots_of:
            holders.setdefault(e, []).append(g)
        claimed = [[False] * self.slots for _ in range(self.num_devices)]
        pairs = list(zip(placement.replica_expert.tolist(), placement.replica_device.tolist()))
        slot_of = [-1] * len(pairs)
        moves: list[Move] = []
        pending = []
        for r, (e, g) in enumerate(pairs):
            hits = slots_of.get((g, e))
            if hits:
                i = hits.pop(0)
                claimed[g][i] = True
                slot_of[r] = i
                moves.append(Move(g, i, e, Source.warm))
            else:
                pending.append(r)
        last_used = self.last_used.tolist()
        for r in pending:
            e, g = pairs[r]
            row, taken = table[g], claimed[g]
            free = [i for i in range(self.slots) if not taken[i]]
            empty = [i for i in free if row[i] == EMPTY]
            i = empty[0] if empty else min(free, key=lambda j: last_used[g][j])
            taken[i] = True
            slot_of[r] = i
            src = holders.get(e)
            if src:
                moves.append(Move(g, i, e, Source.peer, g if g in src else src[0]))  # inside the device if it has e
            else:
                moves.append(Move(g, i, e, Source.host))
            row[i] = e
        self.expert = np.asarray(table, dtype=np.int64)
        self.last_used[np.asarray(claimed)] = self._clock
        slot_of = np.asarray(slot_of, dtype=np.int64)
        return SlotUpdate(slot_of_replica=slot_of, moves=moves)
