"""Layer groups input / middle / output (LayerScope §3.1), found from a trace or set by hand.

LayerScope observes that input and output groups show stronger inter-layer routing correlation,
middle groups higher gate-input cosine similarity. For each target layer j (forecast from j - 1)
we measure both on the training rows:

- similarity_j: mean cosine similarity of the gate inputs at j - 1 and j
  (`core.routing_stats.gate_input_similarity`);
- correlation_j: how much better layer j - 1's experts predict layer j's than layer j's hot experts
  do (hit rate of the transition table minus that of the frequency baseline,
  `core.routing_stats.TransitionTable`).

score_j = z(similarity_j) - z(correlation_j) (z: standardised over the target layers). The middle
group is the contiguous run of target layers with the largest score sum, kept away from both
ends so that input and output groups hold at least one layer each (with >= 3 target layers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from predictors.config import GroupMode, GroupsSpec, LayerGroup
from core.routing_stats import TransitionTable, gate_input_similarity, hit_rate
from core.trace import RoutingTrace


@dataclass(frozen=True)
class LayerGroups:
    """Target MoE layers of each group (ascending), and the statistics they were found from."""

    input: tuple[int, ...]
    middle: tuple[int, ...]
    output: tuple[int, ...]
    mode: str = "manual"
    stats: dict[str, Any] = field(default_factory=dict)

    def of(self, target: int) -> LayerGroup:
        for group in LayerGroup:
            if target in getattr(self, group.value):
                return group
        raise KeyError(f"layer groups: target layer {target} is in no group")

    def as_dict(self) -> dict[str, list[int]]:
        return {g.value: list(getattr(self, g.value)) for g in LayerGroup}

    def to_json(self) -> dict[str, Any]:
        return {**self.as_dict(), "mode": self.mode, "stats": self.stats}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "LayerGroups":
        return cls(input=tuple(d["input"]), middle=tuple(d["middle"]), output=tuple(d["output"]),
                   mode=str(d.get("mode", "manual")), stats=dict(d.get("stats", {})))


def _zscore(x: np.ndarray) -> np.ndarray:
    sd = x.std()
    return (x - x.mean()) / sd if sd > 0 else np.zeros_like(x)


def best_segment(score: np.ndarray, lo: int, hi: int) -> tuple[int, int]:
    """[a, b) with lo <= a < b <= hi maximising score[a:b].sum() (first such segment on ties)."""
    best, best_ab = -np.inf, (lo, lo + 1)
    for a in range(lo, hi):
        total = 0.0
        for b in range(a + 1, hi + 1):
            total += float(score[b - 1])
            if total > best + 1e-12:
                best, best_ab = total, (a, b)
    return best_ab


def split_by_score(targets: Sequence[int], score: np.ndarray) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(input, middle, output) target layers: the middle is the best-scoring interior segment."""
    targets = list(targets)
    n = len(targets)
    if n == 0:
        return (), (), ()
    if n == 1:
        return (targets[0],), (), ()
    if n == 2:
        return (targets[0],), (), (targets[1],)
    a, b = best_segment(np.asarray(score, np.float64), 1, n - 1)
    return tuple(targets[:a]), tuple(targets[a:b]), tuple(targets[b:])


def routing_correlation(trace: RoutingTrace, rows: np.ndarray, source: int, target: int) -> float:
    """Hit rate of a transition table source -> target minus that of the target's hot experts (on `rows`)."""
    E, k = trace.meta.num_experts, trace.meta.top_k
    src, dst = trace.experts[source][rows], trace.experts[target][rows]
    table = TransitionTable(E).fit(src, dst)
    return hit_rate(table.predict(src, k), dst, E) - hit_rate(table.frequency_predict(len(dst), k), dst, E)


def groups_from_data(trace: RoutingTrace, rows: np.ndarray) -> LayerGroups:
    """Layer groups of the target layers 1 .. L-1 from the training rows of a trace with hidden states."""
    L = trace.num_layers
    targets = list(range(1, L))
    sub = trace.select(rows)
    similarity = gate_input_similarity(sub, 1)  # [L - 1]: pair (j - 1, j) at index j - 1
    all_rows = np.ones(sub.num_rows, bool)
    correlation = np.array([routing_correlation(sub, all_rows, j - 1, j) for j in targets])
    score = _zscore(similarity) - _zscore(correlation)
    inp, mid, out = split_by_score(targets, score)
    stats = {"targets": targets, "similarity": similarity.tolist(), "correlation": correlation.tolist(),
             "score": score.tolist()}
    return LayerGroups(input=inp, middle=mid, output=out, mode="data", stats=stats)


def groups_from_spec(spec: GroupsSpec, num_layers: int) -> LayerGroups:
    """Manual groups: `input` and `output` lists of target layers; the rest of 1 .. L-1 is middle."""
    targets = set(range(1, num_layers))
    inp, out = set(spec.input), set(spec.output)
    for key, layers in (("input", inp), ("output", out)):
        bad = sorted(layers - targets)
        if bad:
            raise ValueError(f"llapor.groups.{key}: layers {bad} are not target layers 1..{num_layers - 1}")
    if inp & out:
        raise ValueError(f"llapor.groups: layers {sorted(inp & out)} are in both input and output")
    return LayerGroups(input=tuple(sorted(inp)), middle=tuple(sorted(targets - inp - out)), output=tuple(sorted(out)))


def layer_groups(spec: GroupsSpec, trace: RoutingTrace, rows: np.ndarray) -> LayerGroups:
    """The groups a config asks for: from data (`mode: data`) or from the lists (`mode: manual`)."""
    if spec.mode is GroupMode.manual:
        return groups_from_spec(spec, trace.num_layers)
    return groups_from_data(trace, rows)
