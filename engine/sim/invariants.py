"""Invariants of a recorded simulation, checked from its events (tests, `check_invariants` runs).

1. the link never carries two transfers at once;
2. no expert computes on the GPU before a transfer of its weights that started earlier has ended;
3. staging buffers are never over-subscribed (a staged expert holds its buffer from the start of
   its transfer to the end of its GPU compute); the expert cache's capacity is asserted by the
   pipeline itself at every layer;
4. every (token, expert) pair is computed exactly once: per pass and layer, the experts computed
   on CPU and GPU are disjoint, equal the active ones, and carry exactly their routed tokens (under Expert
   Deferral a CPU expert's on-time and deferred pairs together; under speculative execution the executed pairs);
5. the CPU lane never runs two experts at once (deferred work of one layer and the next layer's CPU experts
   included).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Optional, Sequence

import numpy as np

from engine.offload.accounting import Event
from engine.sim.pipeline import InvariantError
from engine.sim.workload import ForwardPass

EPS = 1e-12


def check_events(events: Sequence[Event], passes: Sequence[ForwardPass], staging_slots: int,
                 executed: Optional[Mapping[tuple[int, int], np.ndarray]] = None) -> None:
    """Raise `InvariantError` naming the first broken invariant."""
    link = sorted((e for e in events if e.lane == "link"), key=lambda e: e.start)
    for a, b in zip(link, link[1:]):
        if b.start < a.end - EPS:
            raise InvariantError(f"link: transfer of ({b.layer}, {b.expert}) starts at {b.start:.6f} "
                                 f"before ({a.layer}, {a.expert}) ends at {a.end:.6f}")
    transfers = defaultdict(list)
    for e in link:
        transfers[(e.layer, e.expert)].append(e)
    cpu = sorted((e for e in events if e.lane == "cpu" and e.end > e.start), key=lambda e: e.start)
    for a, b in zip(cpu, cpu[1:]):
        if b.start < a.end - EPS:
            raise InvariantError(f"cpu: expert ({b.layer}, {b.expert}) starts at {b.start:.6f} before "
                                 f"({a.layer}, {a.expert}) ends at {a.end:.6f}")
    computed: dict[tuple[int, int], dict[int, int]] = defaultdict(dict)
    seen: set[tuple[int, int, int, str]] = set()
    gpu_end: dict[tuple[int, int, int], float] = {}
    for ev in events:
        if ev.kind not in ("expert", "deferred"):
            continue
        if ev.lane == "gpu":
            for t in transfers.get((ev.layer, ev.expert), ()):
                if t.start <= ev.start + EPS and t.end > ev.start + EPS:
                    raise InvariantError(f"gpu: expert ({ev.layer}, {ev.expert}) computes at {ev.start:.6f} while "
                                         f"its transfer runs until {t.end:.6f}")
            gpu_end[(ev.pass_index, ev.layer, ev.expert)] = ev.end
        slot = computed[(ev.pass_index, ev.layer)]
        key = (ev.pass_index, ev.layer, ev.expert, ev.kind)
        if key in seen:
            raise InvariantError(f"pass {ev.pass_index} layer {ev.layer}: expert {ev.expert} computed twice")
        seen.add(key)
        slot[ev.expert] = slot.get(ev.expert, 0) + ev.tokens
    for fp in passes:
        for layer in range(fp.loads.shape[0]):
            loads = (executed or {}).get((fp.index, layer), fp.loads[layer])  # speculative execution's own pairs
            want = {int(e): int(m) for e, m in enumerate(loads) if m > 0}
            got = computed.get((fp.index, layer), {})
            if got != want:
                raise InvariantError(f"pass {fp.index} layer {layer}: computed {got}, routed {want}")
    # staging occupancy: from each staged transfer's start to the end of its GPU compute
    spans = []
    for e in link:
        if e.kind == "staged":
            end = gpu_end.get((e.pass_index, e.layer, e.expert))
            if end is None:
                raise InvariantError(f"staged load ({e.layer}, {e.expert}) never computed on the GPU")
            spans.append((e.start, end))
    points = sorted([(s, 1) for s, _ in spans] + [(t, -1) for _, t in spans], key=lambda p: (p[0], p[1]))
    live = 0
    for _, delta in points:
        live += delta
        if live > staging_slots:
            raise InvariantError(f"staging: {live} buffers in use, {staging_slots} exist")
