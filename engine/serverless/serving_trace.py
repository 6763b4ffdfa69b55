"""The iterations a serving run goes through, with every token's routing (MoEless §6.1 replay).

Azure trace replay: the requests that arrive in the same second form a batch (Megatron-LM has no
continuous batching); a batch runs one prefill iteration over all its prompts (each request's
exact `ContextTokens`), then decode iterations until its longest request has produced its
`GeneratedTokens` (the prefill yields the first token, so request i takes part in
GeneratedTokens_i - 1 decode iterations). Routing comes from a synthetic router (per-request
prefill chains, decode steps following each sequence's previous position) or from a recorded
`RoutingTrace` whose steps are used as they are.

`decode_stride` s > 1 keeps every s-th decode iteration (routing still generated for all, so
temporal locality holds) and gives it weight s in every sum: long replays stay affordable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np

from engine.synthetic_routing import SyntheticRouter
from core.trace import DECODE, PREFILL, RoutingTrace, TraceMeta, TraceRecorder
from engine.workloads.azure import RequestBatch


@dataclass
class ServingTrace:
    """Simulated iterations (steps) and their routing.

    routing: one step per simulated iteration, rows of step s at bounds[s]:bounds[s+1];
    per step: trace time (s), weight (iterations it stands for), phase (0 prefill / 1 decode),
    batch id, sequences, mean context attended; loads int64 [S, L, E] tokens per expert.
    """

    routing: RoutingTrace
    time_s: np.ndarray
    weight: np.ndarray
    phase: np.ndarray
    batch: np.ndarray
    num_seqs: np.ndarray
    context: np.ndarray
    source: str = ""

    def __post_init__(self) -> None:
        self.bounds = self.routing.step_bounds()
        S = len(self.bounds) - 1
        for name in ("time_s", "weight", "phase", "batch", "num_seqs", "context"):
            arr = np.asarray(getattr(self, name))
            if arr.shape != (S,):
                raise ValueError(f"serving trace: {name} has shape {arr.shape}, expected ({S},) (one per step)")
            setattr(self, name, arr)
        self.loads = self._loads()

    def _loads(self) -> np.ndarray:
        L, E = self.routing.num_layers, self.routing.meta.num_experts
        S = self.num_steps
        step_of_row = np.repeat(np.arange(S), np.diff(self.bounds))
        out = np.zeros((S, L, E), dtype=np.int64)
        k = self.routing.meta.top_k
        for layer in range(L):
            idx = np.repeat(step_of_row, k) * E + self.routing.experts[layer].reshape(-1).astype(np.int64)
            out[:, layer] = np.bincount(idx, minlength=S * E).reshape(S, E)
        return out

    @property
    def num_steps(self) -> int:
        return len(self.bounds) - 1

    @property
    def num_layers(self) -> int:
        return self.routing.num_layers

    @property
    def num_experts(self) -> int:
        return self.routing.meta.num_experts

    @property
    def top_k(self) -> int:
        return self.routing.meta.top_k

    def tokens(self, step: int) -> int:
        return int(self.bounds[step + 1] - self.bounds[step])

    def rows(self, step: int) -> np.ndarray:
        return np.arange(self.bounds[step], self.bounds[step + 1])


def _meta(router: SyntheticRouter, source: str) -> TraceMeta:
    return TraceMeta(model=router.model_name, num_experts=router.E, top_k=router.k, moe_layers=router.moe_layers,
                     source=source, extra={"generator": "engine.synthetic_routing"})


def replay_with_synthetic_routing(batches: Iterable[RequestBatch], router: SyntheticRouter, *, seed: int = 0,
                                  decode_stride: int = 1, source: str = "azure") -> ServingTrace:
    """Route the Azure batches' iterations with `router` (one prefill + the decode iterations per batch).

    Batches are independent, so decode step j of every batch is routed in one call (the sequences
    of all batches side by side) and the steps are then recorded batch after batch, in serving order.
    """
    if decode_stride < 1:
        raise ValueError(f"decode_stride must be >= 1, got {decode_stride}")
    rng = np.random.default_rng(seed)
    batches = [b for b in batches if b.num_requests > 0]
    if not batches:
        raise ValueError("serving trace: the workload has no requests")
    prefills, lasts, domains = [], [], []
    for b in batches:
        mine = router.request_domains(b.num_requests, rng)
        domains.append(mine)
        parts = [router.prefill(1, int(c), rng, None if mine is None else mine[i:i + 1])[0]
                 for i, c in enumerate(b.context_tokens)]
        ex = np.concatenate(parts, axis=1)
        prefills.append(ex)
        lasts.append(ex[:, np.cumsum(b.context_tokens) - 1])
    gen = np.concatenate([np.maximum(b.generated_tokens.astype(np.int64), 1) for b in batches])
    owner = np.concatenate([np.full(b.num_requests, i) for i, b in enumerate(batches)])
    last = np.concatenate(lasts, axis=1)  # [L, N, k]: every sequence's previous position
    domain = None if domains[0] is None else np.concatenate(domains)  # [N]: every sequence's request domain
    decoded: list[list[tuple[int, np.ndarray, np.ndarray]]] = [[] for _ in batches]  # (j, seq idx, experts)
    for j in range(int(gen.max()) - 1):
        active = np.flatnonzero(gen - 1 > j)
        new, _ = router.decode(last[:, active], rng, None if domain is None else domain[active])
        last[:, active] = new
        if j % decode_stride:
            continue
        for i in np.unique(owner[active]):
            mine = owner[active] == i
            decoded[i].append((j, active[mine], new[:, mine]))

    rec = TraceRecorder(_meta(router, source))
    zeros = lambda n: [np.zeros((n, router.k), np.float32)] * router.L
    time_s, weight, phase, batch_ids, seqs, context = [], [], [], [], [], []
    first = 0
    for i, b in enumerate(batches):
        n = b.num_requests
        ctx = b.context_tokens.astype(np.int64)
        seq = np.arange(first, first + n)
        ex = prefills[i]
        rec.add_step(list(ex), zeros(ex.shape[1]), seq=np.repeat(seq, ctx),
                     pos=np.concatenate([np.arange(c) for c in ctx]), phase=PREFILL)
        time_s.append(b.start_s), weight.append(1.0), phase.append(PREFILL), batch_ids.append(b.index)
        seqs.append(n), context.append(float(ctx.mean()))
        steps = int(gen[first:first + n].max()) - 1
        for j, idx, new in decoded[i]:
            local = idx - first
            rec.add_step(list(new), zeros(idx.size), seq=idx, pos=ctx[local] + j, phase=DECODE)
            time_s.append(b.start_s), weight.append(float(min(decode_stride, steps - j))), phase.append(DECODE)
            batch_ids.append(b.index), seqs.append(idx.size), context.append(float((ctx[local] + j + 1).mean()))
        first += n
    return ServingTrace(routing=rec.build(), time_s=np.asarray(time_s), weight=np.asarray(weight),
                        phase=np.asarray(phase, np.int8), batch=np.asarray(batch_ids, np.int64),
                        num_seqs=np.asarray(seqs, np.int64), context=np.asarray(context), source=source)


def from_routing_trace(trace: RoutingTrace, seconds_per_batch: float = 1.0, batch_times: Optional[np.ndarray] = None,
                       decode_stride: int = 1, source: Optional[str] = None) -> ServingTrace:
    """A recorded trace as it is (prefill steps start batches): step times from `batch_times` (one
    per batch, in order) or batch index x `seconds_per_batch`; every `decode_stride`-th decode step
    of a batch is kept, with the weight of the steps it stands for."""
    if decode_stride < 1:
        raise ValueError(f"decode_stride must be >= 1, got {decode_stride}")
    b = trace.step_bounds()
    first = b[:-1]
    phase = trace.phase[first]
    batch = np.cumsum(phase == PREFILL) - 1 if (phase == PREFILL).any() else trace.batch[first].astype(np.int64)
    batch = np.maximum(batch, 0)
    index_in_batch = np.zeros(len(first), np.int64)
    for i in range(1, len(first)):
        index_in_batch[i] = 0 if batch[i] != batch[i - 1] else index_in_batch[i - 1] + 1
    decode_no = index_in_batch - (phase[np.searchsorted(batch, batch)] == PREFILL)  # decode iteration j of its batch
    keep = (phase == PREFILL) | (decode_no % decode_stride == 0)
    weight = np.ones(len(first))
    last_decode = {int(x): int(decode_no[batch == x].max()) for x in np.unique(batch)}
    for i in np.flatnonzero(keep & (phase == DECODE)):
        weight[i] = min(decode_stride, last_decode[int(batch[i])] - decode_no[i] + 1)
    if batch_times is not None:
        if len(batch_times) < int(batch.max()) + 1:
            raise ValueError(f"serving trace: {len(batch_times)} batch times for {int(batch.max()) + 1} batches")
        times = np.asarray(batch_times, np.float64)[batch]
    else:
        times = batch.astype(np.float64) * seconds_per_batch
    kept_steps = np.flatnonzero(keep)
    if not keep.all():
        rows = np.concatenate([np.arange(b[i], b[i + 1]) for i in kept_steps])
        trace = trace.select(rows)
    seqs = [len(np.unique(trace.seq[lo:hi])) for lo, hi in zip(trace.step_bounds()[:-1], trace.step_bounds()[1:])]
    ctx = [float(trace.pos[lo:hi].mean()) + 1 for lo, hi in zip(trace.step_bounds()[:-1], trace.step_bounds()[1:])]
    return ServingTrace(routing=trace, time_s=times[kept_steps], weight=weight[kept_steps], phase=phase[kept_steps].astype(np.int8),
                        batch=batch[kept_steps], num_seqs=np.asarray(seqs, np.int64), context=np.asarray(ctx),
                        source=source or trace.meta.source)
