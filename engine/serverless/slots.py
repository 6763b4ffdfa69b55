"""Which replica sits in which slot of which device, and what a new placement has to move.

Bookkeeping shared by the real replica store and the simulator (numpy only). Each device offers S
slots per MoE layer. Applying a placement:

- a replica of expert e placed on device g reuses a slot of g that already holds e (a warm start:
  nothing moves);
- otherwise it takes a free slot of g (an empty one first, else the least recently used slot the
  new placement does not need) and its weights come from a peer device that holds e right now
  (device-to-device copy) or, if none does, from host memory;
- slots the new placement does not use keep their expert alive (serverless keep-alive): a later
  placement may warm-start from them until they are overwritten, or, with a keep-alive window, until
  the window after their last use has passed (`expire`: the slot is freed and its memory no longer
  held). A kept-alive replica is resident: it is held (and billed as held) like one in use.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from schedulers.ep_placement import Placement

EMPTY = -1


class Source(enum.Enum):
    warm = "warm"  # already in the slot
    peer = "peer"  # copied from another device holding the expert
    host = "host"  # copied from the host master copy


class Move(NamedTuple):  # a tuple, not a dataclass: one is built per replica per layer per iteration
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
    warm_first: int = 0  # moves[:warm_first] are warm starts (`SlotMap.apply` lists them first)

    def count(self, source: Source) -> int:
        return sum(1 for m in self.moves if m.source is source)

    def tally(self, num_devices: int) -> tuple[dict[Source, int], np.ndarray, np.ndarray]:
        """Moves per source, and the host and peer copies each device receives (float [G] each)."""
        counts = dict.fromkeys(Source, 0)
        counts[Source.warm] = self.warm_first
        host_in, peer_in = [0.0] * num_devices, [0.0] * num_devices  # lists: per-element numpy updates are slow
        for m in self.moves[self.warm_first:]:
            counts[m.source] += 1
            if m.source is Source.host:
                host_in[m.device] += 1
            elif m.source is Source.peer:
                peer_in[m.device] += 1
        return counts, np.asarray(host_in), np.asarray(peer_in)


class SlotMap:
    """The slots of one MoE layer on G devices."""

    def __init__(self, num_experts: int, num_devices: int, slots_per_device: int):
        if slots_per_device < 1:
            raise ValueError(f"slots_per_device must be >= 1, got {slots_per_device}")
        self.num_experts = num_experts
        self.num_devices = num_devices
        self.slots = slots_per_device
        # plain lists [G][S]: the simulator applies a placement per layer per iteration, and numpy's
        # per-call overhead on these few slots was most of its time
        self._table = [[EMPTY] * slots_per_device for _ in range(num_devices)]
        self._last_used = [[-1] * slots_per_device for _ in range(num_devices)]
        self._last_time = [[0.0] * slots_per_device for _ in range(num_devices)]  # trace time of the last claim
        self._resident = 0
        self._idle = 0  # resident slots the last update did not claim (kept alive)
        self._clock = 0
        self._live: Placement | None = None

    @property
    def expert(self) -> np.ndarray:
        """int64 [G, S]: the expert alive in each slot (EMPTY where none)."""
        return np.asarray(self._table, dtype=np.int64).reshape(self.num_devices, self.slots)

    @property
    def last_used(self) -> np.ndarray:
        """int64 [G, S]: the update that last claimed each slot (-1: never)."""
        return np.asarray(self._last_used, dtype=np.int64).reshape(self.num_devices, self.slots)

    def live(self) -> Placement | None:
        """Every expert alive in a slot (kept-alive ones included), device by device, slot by slot; None
        while all slots are empty."""
        if self._live is None:
            if not self._resident:
                return None
            pairs = [(e, g) for g, row in enumerate(self._table) for e in row if e != EMPTY]
            experts, devices = zip(*pairs)
            self._live = Placement.trusted(self.num_experts, self.num_devices, list(experts), list(devices))
        return self._live

    def resident_replicas(self) -> int:
        """Replicas held on the devices: the ones in use and the kept-alive ones."""
        return self._resident

    def expire(self, now_s: float, keep_alive_s: float | None) -> int:
        """Free every slot whose replica has not been used for more than `keep_alive_s` seconds of trace time
        (None: never; 0: a replica lives only while a placement uses it). Returns the slots freed."""
        if keep_alive_s is None or not self._idle:
            return 0
        freed = 0
        for g, row in enumerate(self._table):
            times, used = self._last_time[g], self._last_used[g]
            for i, e in enumerate(row):
                # the replicas of the last placement are in use, whatever the window
                if e != EMPTY and used[i] != self._clock and now_s - times[i] >= keep_alive_s:
                    row[i] = EMPTY
                    freed += 1
        if freed:
            self._resident -= freed
            self._idle -= freed
            self._live = None
        return freed

    def apply(self, placement: Placement, now_s: float = 0.0, peer_copies: bool = True) -> SlotUpdate:
        """Assign every replica of `placement` a slot at trace time `now_s`; return the slots and the copies to make."""
        if placement.num_devices != self.num_devices or placement.num_experts != self.num_experts:
            raise ValueError(f"slot map: placement for {placement.num_experts} experts / {placement.num_devices} "
                             f"devices, map has {self.num_experts} / {self.num_devices}")
        placement.check_capacity(self.slots)
        self._clock += 1
        self._live = None
        table = self._table
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
        last_used = self._last_used
        for r in pending:
            e, g = pairs[r]
            row, taken = table[g], claimed[g]
            free = [i for i in range(self.slots) if not taken[i]]
            empty = [i for i in free if row[i] == EMPTY]
            i = empty[0] if empty else min(free, key=lambda j: last_used[g][j])
            taken[i] = True
            slot_of[r] = i
            src = holders.get(e) if peer_copies else None
            if src:
                moves.append(Move(g, i, e, Source.peer, g if g in src else src[0]))  # inside the device if it has e
            else:
                moves.append(Move(g, i, e, Source.host))
            self._resident += row[i] == EMPTY
            row[i] = e
        for g, taken in enumerate(claimed):
            times = self._last_time[g]
            for i, t in enumerate(taken):
                if t:
                    last_used[g][i] = self._clock
                    times[i] = now_s
        self._idle = self._resident - len(pairs)
        slot_of = np.asarray(slot_of, dtype=np.int64)
        return SlotUpdate(slot_of_replica=slot_of, moves=moves, warm_first=len(pairs) - len(pending))
