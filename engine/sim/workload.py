"""Forward passes to replay: a routing trace cut into prefill / decode passes with per-layer loads.

A recorded trace already holds batched passes (one prefill step, then decode steps). Imported
per-sequence logs (one sequence per step), or recorded batches of another size, are regrouped by
`batch_sequences` into passes of `batch` sequences: the prefill rows of the group, then their first
decode rows, and so on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from core.trace import DECODE, PREFILL, RoutingTrace


@dataclass
class ForwardPass:
    """One forward pass of the replay (rows of the trace it covers and what it costs)."""

    index: int
    batch_id: int
    phase: int  # core.trace.PREFILL / DECODE
    rows: np.ndarray  # int64 [T] trace rows
    num_seqs: int
    context_len: int  # decode: mean KV length attended to; prefill: prompt length (mean)
    loads: np.ndarray  # int64 [L, E] tokens per expert per MoE layer
    scores: np.ndarray  # float64 [L, E] summed routing weights per expert per MoE layer
    microbatch_loads: Optional[np.ndarray] = None  # int64 [M, L, E], filled on demand

    @property
    def tokens(self) -> int:
        return int(self.rows.shape[0])

    @property
    def prefill(self) -> bool:
        return self.phase == PREFILL


def layer_loads(trace: RoutingTrace, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Tokens (int64 [L, E]) and summed weights (float64 [L, E]) of `rows` per MoE layer."""
    L, E = trace.num_layers, trace.meta.num_experts
    ex = trace.experts[:, rows].reshape(L, -1).astype(np.int64)
    w = trace.weights[:, rows].reshape(L, -1).astype(np.float64)
    flat = ex + (np.arange(L, dtype=np.int64) * E)[:, None]
    loads = np.bincount(flat.ravel(), minlength=L * E).reshape(L, E)
    scores = np.bincount(flat.ravel(), weights=w.ravel(), minlength=L * E).reshape(L, E)
    return loads, scores


def batch_sequences(trace: RoutingTrace, batch: int) -> RoutingTrace:
    """Regroup a trace into passes of `batch` sequences each: their prefill rows, then their first
    decode rows, and so on (sequences in order of first appearance)."""
    if batch < 1:
        raise ValueError(f"batch_sequences: batch must be >= 1, got {batch}")
    seqs = list(dict.fromkeys(trace.seq.tolist()))
    by_seq: dict[int, list[np.ndarray]] = {s: [] for s in seqs}
    for _, sl in trace.iter_steps():
        rows = np.arange(sl.start, sl.stop)
        ids = trace.seq[sl]
        for s in dict.fromkeys(ids.tolist()):
            by_seq[s].append(rows[ids == s])
    order: list[np.ndarray] = []
    step_ids: list[np.ndarray] = []
    batch_ids: list[np.ndarray] = []
    step = 0
    for b in range(0, len(seqs), batch):
        group = seqs[b:b + batch]
        depth = max(len(by_seq[s]) for s in group)
        for d in range(depth):
            rows_cat = np.concatenate([by_seq[s][d] for s in group if d < len(by_seq[s])])
            order.append(rows_cat)
            step_ids.append(np.full(rows_cat.size, step, np.int32))
            batch_ids.append(np.full(rows_cat.size, b // batch, np.int32))
            step += 1
    idx = np.concatenate(order)
    return RoutingTrace(meta=trace.meta, experts=trace.experts[:, idx], weights=trace.weights[:, idx],
                        step=np.concatenate(step_ids), batch=np.concatenate(batch_ids), seq=trace.seq[idx],
                        pos=trace.pos[idx], token=trace.token[idx], phase=trace.phase[idx],
                        hidden=None if trace.hidden is None else trace.hidden[:, idx])


def sequences_per_batch(trace: RoutingTrace) -> int:
    """Sequences in the trace's prefill passes (the largest)."""
    bounds = trace.step_bounds()
    counts = [np.unique(trace.seq[bounds[i]:bounds[i + 1]]).size for i in range(len(bounds) - 1)
              if trace.phase[bounds[i]] == PREFILL]
    return max(counts, default=0)


def forward_passes(trace: RoutingTrace) -> list[ForwardPass]:
    """The trace's forward passes in order, with per-layer expert loads (regroup first with
    `batch_sequences` to replay other batch sizes)."""
    passes: list[ForwardPass] = []
    for i, (_, sl) in enumerate(trace.iter_steps()):
        rows = np.arange(sl.start, sl.stop, dtype=np.int64)
        phase = int(trace.phase[sl.start])
        seqs = np.unique(trace.seq[sl])
        if phase == DECODE:
            ctx = int(round(float(trace.pos[sl].mean()))) + 1
        else:
            ctx = int(round(rows.size / max(seqs.size, 1)))
        loads, scores = layer_loads(trace, rows)
        passes.append(ForwardPass(i, int(trace.batch[sl.start]), phase, rows, int(seqs.size), ctx, loads, scores))
    return passes


def microbatch_loads(trace: RoutingTrace, fp: ForwardPass, micro_batches: int) -> np.ndarray:
    """int64 [M, L, E]: loads of each micro-batch (sequences split into M contiguous groups)."""
    if fp.microbatch_loads is not None and fp.microbatch_loads.shape[0] == micro_batches:
        return fp.microbatch_loads
    seqs = trace.seq[fp.rows]
    uniq = np.unique(seqs)
    groups = np.array_split(uniq, micro_batches)
    out = np.stack([layer_loads(trace, fp.rows[np.isin(seqs, g)])[0] for g in groups])
    fp.microbatch_loads = out
    return out


def profile_loads(trace: RoutingTrace) -> np.ndarray:
    """int64 [L, E]: tokens per expert over a whole (profiling) trace: the hot-table Counter."""
    return trace.expert_loads()


__all__ = ["ForwardPass", "forward_passes", "batch_sequences", "layer_loads", "microbatch_loads", "profile_loads",
           "sequences_per_batch", "PREFILL", "DECODE"]
