"""The MoE block, split in two: a router (which experts, what weights) and an expert executor.

`Routing` is what the router returns for T tokens. An `ExpertExecutor` turns (tokens, routing)
into the weighted sum of expert outputs, in float32: the block rounds it to the model's dtype once,
so an executor that adds experts computed in several places (the offload executor's CPU and device
parts) rounds exactly where the in-memory model does. The default `InMemoryExperts` computes it
from the block's own expert weights inside the jitted forward. The offload executor (`engine/offload`) and
the expert-parallel executor (`engine/serverless`) plug in through the same call.

Expert weights are stored as one array per expert (not stacked [E, ...]): on XLA:CPU, slicing
experts out of a stacked array copies them (notes-cpu-performance.md), which dominates decode.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional, Protocol, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from models import native
from models.config import ModelConfig, ScoringFunc, TopkMethod
from models.layers import SwiGLU, _init, linear
from models.quant.matmul import expert_swiglu, is_quantized


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Routing:
    """experts [T, k] int32; weights [T, k] float32 (what multiplies each expert's output);
    logits [T, E] float32 (raw router logits, for auxiliary losses and statistics); valid bool [T]
    or None: False for padding rows, whose outputs are discarded (executors may skip them)."""

    experts: jax.Array
    weights: jax.Array
    logits: jax.Array
    valid: Optional[jax.Array] = None


# ---- routers ------------------------------------------------------------------------------------


def _topk(scores: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    values, idx = jax.lax.top_k(scores, k)
    return values, idx.astype(jnp.int32)


def route(cfg: ModelConfig, logits: jax.Array, bias: Optional[jax.Array] = None,
          jitter_key: Optional[jax.Array] = None) -> Routing:
    """Routing of T tokens from router logits [T, E] as the family's HF implementation does it."""
    logits = logits.astype(jnp.float32)
    k = cfg.num_experts_per_tok
    if cfg.scoring_func is ScoringFunc.sparsemixer:
        return sparsemixer_route(cfg, logits)
    if cfg.scoring_func is ScoringFunc.sigmoid:
        scores = jax.nn.sigmoid(logits)
    else:
        scores = jax.nn.softmax(logits, axis=-1)
    if cfg.topk_method is TopkMethod.greedy:
        weights, experts = _topk(scores, k)
    else:
        choice = scores if bias is None else scores + bias[None, :]
        experts = grouped_topk(cfg, choice)
        weights = jnp.take_along_axis(scores, experts, axis=-1)
    if cfg.norm_topk_prob and k > 1:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + (1e-20 if cfg.scoring_func is ScoringFunc.sigmoid else 0.0))
    weights = weights * cfg.routed_scaling_factor
    return Routing(experts=experts, weights=weights, logits=logits)


def sparsemixer_route(cfg: ModelConfig, logits: jax.Array) -> Routing:
    """PhiMoE's sparsemixer top-2 at inference: the best expert, then the best of the rest.

    Each pick's weight is a softmax over the logits that lie within a relative distance
    2 * router_jitter_noise of that pick (the others are masked to -inf).
    """
    eps = cfg.router_jitter_noise
    T = logits.shape[0]
    rows = jnp.arange(T)

    def pick(candidates: jax.Array) -> tuple[jax.Array, jax.Array]:
        best = jnp.argmax(candidates, axis=-1).astype(jnp.int32)
        threshold = candidates[rows, best][:, None]
        factor = jnp.maximum(jnp.abs(logits), threshold)
        keep = ~(((threshold - logits) / factor) > 2 * eps)  # written as HF does, so NaN (0/0) keeps
        gates = jax.nn.softmax(jnp.where(keep, candidates, -jnp.inf), axis=-1)
        return best, gates[rows, best]

    first, w_first = pick(logits)
    second, w_second = pick(logits.at[rows, first].set(-jnp.inf))
    return Routing(experts=jnp.stack([first, second], axis=-1), weights=jnp.stack([w_first, w_second], axis=-1),
                   logits=logits)


def grouped_topk(cfg: ModelConfig, scores: jax.Array) -> jax.Array:
    """Group-limited top-k (DeepSeek): keep the best `topk_group` of `n_group` expert groups, then top-k.

    Group score: max of the group for group_limited_greedy (V2), sum of the group's top-2 for noaux_tc (V3).
    """
    T, E = scores.shape
    g = cfg.n_group
    grouped = scores.reshape(T, g, E // g)
    if cfg.topk_method is TopkMethod.noaux_tc:
        group_scores = jnp.sum(jax.lax.top_k(grouped, min(2, E // g))[0], axis=-1)
    else:
        group_scores = jnp.max(grouped, axis=-1)
    _, top_groups = jax.lax.top_k(group_scores, cfg.topk_group)
    keep = jnp.zeros((T, g), bool).at[jnp.arange(T)[:, None], top_groups].set(True)
    # HF masks dropped groups with -inf for V3 (biased sigmoid scores) and 0.0 for V2 (softmax scores).
    masked = jnp.where(jnp.repeat(keep, E // g, axis=1), scores, -jnp.inf if cfg.topk_method is TopkMethod.noaux_tc else 0.0)
    return _topk(masked, cfg.num_experts_per_tok)[1]


class Router(nnx.Module):
    """Router of one MoE layer: weight [E, H] (+ DeepSeek-V3's e_score_correction_bias [E])."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.float32):
        self.cfg = cfg
        self.weight = nnx.Param(_init(rngs, (cfg.num_experts, cfg.hidden_size), dtype))
        self.bias = nnx.Param(jnp.zeros((cfg.num_experts,), jnp.float32)) \
            if cfg.topk_method is TopkMethod.noaux_tc else None

    def logits(self, x: jax.Array) -> jax.Array:
        """x [T, H] -> float32 [T, E] (computed in float32 whatever the weights' dtype)."""
        return linear(x.astype(jnp.float32), self.weight[...].astype(jnp.float32))

    def __call__(self, x: jax.Array) -> Routing:
        """x [T, H] -> Routing for T tokens."""
        return route(self.cfg, self.logits(x), None if self.bias is None else self.bias[...])


# ---- experts ------------------------------------------------------------------------------------


class RoutedExperts(nnx.Module):
    """The routed experts of one layer: per expert gate|up rows [2F, H] (gate first) and down [H, F]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, *, rngs: nnx.Rngs,
                 dtype: jnp.dtype = jnp.float32):
        self.gate_up = nnx.List([nnx.Param(_init(rngs, (2 * intermediate, hidden), dtype)) for _ in range(num_experts)])
        self.down = nnx.List([nnx.Param(_init(rngs, (hidden, intermediate), dtype)) for _ in range(num_experts)])

    @property
    def num_experts(self) -> int:
        return len(self.gate_up)

    def arrays(self) -> tuple[list[jax.Array], list[jax.Array]]:
        return [p[...] for p in self.gate_up], [p[...] for p in self.down]


class ExpertExecutor(Protocol):
    """Computes sum_j weights[t, j] * Expert_{experts[t, j]}(x[t]) for one MoE layer."""

    def __call__(self, layer: int, x: jax.Array, routing: Routing, experts: Optional[RoutedExperts]) -> jax.Array:
        """x [T, H], routing for T tokens -> float32 [T, H] (unrounded). `layer` is the decoder-layer index."""
        ...


def combine_matrix(routing: Routing, num_experts: int) -> jax.Array:
    """[T, E] float32: the weight of expert e in token t's output (0 where not routed)."""
    T, k = routing.experts.shape
    return jnp.zeros((T, num_experts), jnp.float32).at[jnp.arange(T)[:, None], routing.experts].add(routing.weights)


def experts_per_slot(x: jax.Array, routing: Routing, gate_up: Sequence[jax.Array], down: Sequence[jax.Array]
                     ) -> jax.Array:
    """Few tokens: one `lax.switch` per (token, slot) so only the chosen experts' weights are read."""
    T, k = routing.experts.shape
    branches = [lambda row, gu=gu, dn=dn: expert_swiglu(row, gu, dn) for gu, dn in zip(gate_up, down)]
    rows = []
    for t in range(T):
        acc = jnp.zeros((1, x.shape[-1]), jnp.float32)
        for j in range(k):
            y = jax.lax.switch(routing.experts[t, j], branches, x[t:t + 1])
            acc = acc + routing.weights[t, j] * y
        rows.append(acc)
    return jnp.concatenate(rows, axis=0)


def experts_dense_skip(x: jax.Array, routing: Routing, gate_up: Sequence[jax.Array], down: Sequence[jax.Array]
                       ) -> jax.Array:
    """Moderate token counts: every used expert runs on all T tokens (weights read once), unused skipped."""
    comb = combine_matrix(routing, len(gate_up))
    out = jnp.zeros(x.shape, jnp.float32)
    for e, (gu, dn) in enumerate(zip(gate_up, down)):
        w = comb[:, e:e + 1]
        out = jax.lax.cond(jnp.any(w > 0), lambda o, gu=gu, dn=dn, w=w: o + expert_swiglu(x, gu, dn) * w,
                           lambda o: o, out)
    return out


def group_by_expert(routing: Routing, num_experts: int, pad: int
                    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The T*k (token, slot) pairs sorted by expert: token [n + pad], weight [n + pad], and per expert
    its pair count [E] and first sorted position [E]. Pairs of padding rows (`routing.valid` False) and
    expert ids outside [0, E) are left out (sorted past every expert's range)."""
    T, k = routing.experts.shape
    flat_e = routing.experts.reshape(-1)
    if routing.valid is not None:
        flat_e = jnp.where(jnp.repeat(routing.valid, k), flat_e, num_experts)
    flat_e = jnp.where((flat_e >= 0) & (flat_e < num_experts), flat_e, num_experts)
    order = jnp.argsort(flat_e, stable=True)
    tok = (order // k).astype(jnp.int32)
    wts = routing.weights.reshape(-1)[order]
    counts = jnp.bincount(flat_e, length=num_experts)
    starts = jnp.cumsum(counts) - counts
    tok = jnp.concatenate([tok, jnp.zeros((pad,), jnp.int32)])
    wts = jnp.concatenate([wts, jnp.zeros((pad,), wts.dtype)])
    return tok, wts, counts.astype(jnp.int32), starts.astype(jnp.int32)


DENSE_FIRST_CHUNK = 4
"""Pairs per expert from which `experts_grouped` may run every expert's first chunk without a `cond`
(under uniform routing an expert is then unused with probability about exp(-4))."""
SMALL_CHUNK = 8
"""The largest chunk (rows) run that way: such a call runs on one core, so independent calls fill
both; larger calls are spread over the cores by the dot library itself, and running them side by
side measured ~10% slower (prefill of 64 tokens, chunk 16)."""


def default_chunk(num_pairs: int, num_experts: int) -> int:
    """Rows per expert call: the mean pairs per expert rounded up to a power of two (at least 8)."""
    return max(8, 1 << max(0, math.ceil(math.log2(max(1, math.ceil(num_pairs / num_experts))))))


def experts_grouped(x: jax.Array, routing: Routing, gate_up: Sequence[jax.Array], down: Sequence[jax.Array],
                    chunk: Optional[int] = None) -> jax.Array:
    """Many tokens: pairs sorted by expert, each expert runs over its own rows in chunks of `chunk` rows.

    Exact for any routing: an expert with n rows runs ceil(n / chunk) times (any chunk after the first
    in a loop that is entered only on overflow). Decode batches whose pairs are at least
    `DENSE_FIRST_CHUNK` times the experts (nearly every expert used) and whose chunks are small run
    every expert's first chunk unconditionally: the calls are then independent of one another and
    XLA:CPU runs them on both cores, where a chain of `cond`s runs them one by one (batch 16 of the
    29M Mixtral: decode 12-21% faster). Otherwise a `cond` skips each unused expert.
    """
    T, k = routing.experts.shape
    E, H = len(gate_up), x.shape[-1]
    chunk = chunk or default_chunk(T * k, E)
    tok, wts, counts, starts = group_by_expert(routing, E, pad=chunk)
    xs = x[tok]
    rows = jnp.arange(chunk)

    def run_chunk(e: int, i: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Chunk i of expert e: (weighted outputs f32 [chunk, H], their token ids [chunk])."""
        start = starts[e] + i * chunk
        live = rows + i * chunk < counts[e]
        w = jnp.where(live, jax.lax.dynamic_slice(wts, (start,), (chunk,)), 0.0)
        y = expert_swiglu(jax.lax.dynamic_slice(xs, (start, 0), (chunk, H)), gate_up[e], down[e])
        return jnp.where(live[:, None], y * w[:, None], 0.0), jax.lax.dynamic_slice(tok, (start,), (chunk,))

    def add_chunk(e: int, i: jax.Array, acc: jax.Array) -> jax.Array:
        y, t = run_chunk(e, i)
        return acc.at[t].add(y)

    out = jnp.zeros((T, H), jnp.float32)
    n_chunks = (counts + chunk - 1) // chunk
    if T * k >= DENSE_FIRST_CHUNK * E and chunk <= SMALL_CHUNK:
        ys, ts = zip(*(run_chunk(e, jnp.int32(0)) for e in range(E)))
        out = out.at[jnp.concatenate(ts)].add(jnp.concatenate(ys))
    else:
        for e in range(E):
            out = jax.lax.cond(n_chunks[e] > 0, lambda acc, e=e: add_chunk(e, jnp.int32(0), acc), lambda acc: acc, out)
    if T * k > chunk:  # overflow chunks are possible
        for e in range(E):
            out = jax.lax.cond(n_chunks[e] > 1, lambda acc, e=e: jax.lax.fori_loop(
                1, n_chunks[e], lambda i, a, e=e: add_chunk(e, i, a), acc), lambda acc: acc, out)
    return out


def experts_native(x: jax.Array, routing: Routing, gate_up: Sequence[jax.Array], down: Sequence[jax.Array]
                   ) -> jax.Array:
    """On the CPU: every expert of the layer in one native call over exactly its live pairs (each used expert's
    weights read once, unused ones never touched), whatever the token count."""
    tok, wts, offsets = native_pairs(routing, len(gate_up))
    if is_quantized(gate_up[0]):  # block-type experts: the native kernels quantize the activations as llama.cpp
        return native.qexperts(x, tok, wts, offsets, list(gate_up), list(down))
    return native.experts(x, tok, wts, offsets, list(gate_up), list(down))


def native_pairs(routing: Routing, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The native expert calls' pair lists: token int32 [P] and weight float32 [P] of every (token, slot) pair
    grouped by expert, and offsets int32 [E + 1] (expert e's pairs are offsets[e] .. offsets[e + 1])."""
    tok, wts, counts, starts = group_by_expert(routing, num_experts, pad=0)
    offsets = jnp.concatenate([starts, (starts[-1] + counts[-1])[None]]).astype(jnp.int32)
    return tok, wts.astype(jnp.float32), offsets


def experts_native_stacked(x: jax.Array, routing: Routing, experts: Any) -> jax.Array:
    """`experts_native` over a `models.quant.experts.StackedQuantExperts`: its three stacked block arrays go to the
    kernel whole (three program parameters per layer, not three per expert); the same kernel and numbers."""
    tok, wts, offsets = native_pairs(routing, experts.num_experts)
    return native.qexperts_stacked(x, tok, wts, offsets, *experts.stacks(), qgu=experts.gate_up_type,
                                   qdown=experts.down_type)


def native_reads_stacks(x: jax.Array, experts: Any) -> bool:
    """Whether `experts_native_stacked` computes these stacked block experts on the CPU (`native_reads` for them)."""
    return (x.dtype in (jnp.bfloat16, jnp.float32) and native.available_experts()
            and native.reads_blocks(experts.gate_up_type, experts.down_type))


@functools.lru_cache(maxsize=1)
def only_cpu() -> bool:
    """Whether this process has no accelerator backend: every program is then lowered for the CPU alone."""
    for platform in ("cuda", "rocm", "tpu", "gpu"):
        try:
            if jax.devices(platform):
                return False
        except RuntimeError:  # no such backend here
            continue
    return True


def native_reads(x: jax.Array, gate_up: Any, down: Any) -> bool:
    """Whether `experts_native` computes experts of these weights on the CPU: bf16 / f32 weights of x's dtype, or
    block types the kernels read (Q5_0, a K-quant's fallback, is left to the dequantizing XLA path)."""
    if x.dtype not in (jnp.bfloat16, jnp.float32) or not native.available_experts():
        return False
    if is_quantized(gate_up):
        first = gate_up[0] if isinstance(gate_up, tuple) else gate_up
        return native.reads_blocks(first.qtype, down.qtype)
    return x.dtype == gate_up.dtype


class InMemoryExperts:
    """Default executor: the layer's own expert weights, strategy chosen by token count at trace time.

    On the CPU backend: `experts_native` (XLA:CPU has no bf16 dot of its own, and its per-expert calls cost
    more than the experts themselves at decode sizes). Elsewhere (or without the native library):
    T * k <= slot_limit (batch-1 decode): a `switch` per (token, slot) reads only the chosen experts.
    T <= dense_limit: each used expert runs on all T rows (no gather/scatter; unused experts skipped).
    Otherwise (larger decode batches, prefill): pairs grouped by expert, `chunk` rows per expert call.
    Quantized experts (`models.quant.QuantExperts`, `StackedQuantExperts`) run the native block kernels on the CPU
    where they read the types (Q8 activations, as llama.cpp's); elsewhere the XLA strategies, each expert through
    `models.quant.matmul.expert_swiglu` (its blocks dequantized inside the chosen branch).
    """

    layer_free = True
    """The output does not depend on the layer index: `models.transformer.forward` may trace one layer of each
    structure and call it from every layer."""

    def __init__(self, slot_limit: int = 4, dense_limit: int = 8, chunk: Optional[int] = None):
        self.slot_limit, self.dense_limit, self.chunk = slot_limit, dense_limit, chunk

    def _key(self) -> tuple:
        return self.slot_limit, self.dense_limit, self.chunk

    def __hash__(self) -> int:  # a static jit argument: equal settings share compiled programs
        return hash((type(self), self._key()))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, InMemoryExperts) and other._key() == self._key()

    def __call__(self, layer: int, x: jax.Array, routing: Routing, experts: Optional[RoutedExperts]) -> jax.Array:
        if experts is None:
            raise ValueError(f"layer {layer}: the model holds no expert weights; pass an expert executor")
        if hasattr(experts, "stacks") and native_reads_stacks(x, experts):  # a GGUF file's stacked tensors, whole
            if only_cpu():
                return experts_native_stacked(x, routing, experts)
            return jax.lax.platform_dependent(x, routing, cpu=lambda x, r: experts_native_stacked(x, r, experts),
                                              default=lambda x, r: self.by_count(x, r, *experts.arrays()))
        gate_up, down = experts.arrays()
        if native_reads(x, gate_up[0], down[0]):
            if only_cpu():  # the other branch would be lowered away, but tracing it is most of a layer's trace
                return experts_native(x, routing, gate_up, down)  # (E experts' XLA branches: ~1 min per layer kind)
            return jax.lax.platform_dependent(x, routing, gate_up, down, cpu=experts_native, default=self.by_count)
        return self.by_count(x, routing, gate_up, down)

    def by_count(self, x: jax.Array, routing: Routing, gate_up: Sequence[jax.Array], down: Sequence[jax.Array]
                 ) -> jax.Array:
        """The XLA strategies, by token count (see the class docstring)."""
        T, k = routing.experts.shape
        # quantized experts skip the per-slot switch: T * k copies of every expert's dequantizing branch compile
        # slowly (~1 s per switch of 8 on XLA:CPU), and each used expert's blocks are read once either way
        if T * k <= self.slot_limit and not is_quantized(gate_up[0]):
            return experts_per_slot(x, routing, gate_up, down)
        if T <= self.dense_limit:
            return experts_dense_skip(x, routing, gate_up, down)
        return experts_grouped(x, routing, gate_up, down, self.chunk)


DEFAULT_EXECUTOR = InMemoryExperts()


class MoEBlock(nnx.Module):
    """Router + routed experts (+ shared experts). Holds no expert weights when `with_experts` is False."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, dtype: jnp.dtype = jnp.float32, with_experts: bool = True):
        self.cfg = cfg
        self.router = Router(cfg, rngs=rngs, dtype=dtype)
        self.experts = RoutedExperts(cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate_size, rngs=rngs,
                                     dtype=dtype) if with_experts else None
        self.shared = SwiGLU(cfg.hidden_size, cfg.expert_intermediate_size * cfg.n_shared_experts, rngs=rngs,
                             dtype=dtype) if cfg.n_shared_experts else None

    def __call__(self, layer: int, x: jax.Array, executor: ExpertExecutor, valid: Optional[jax.Array] = None
                 ) -> tuple[jax.Array, Routing]:
        """x [T, H] (the gate input), valid bool [T] -> (MoE output [T, H], routing)."""
        routing = dataclasses.replace(self.router(x), valid=valid)
        y = executor(layer, x, routing, self.experts).astype(x.dtype)
        if self.shared is not None:
            y = y + self.shared(x)
        return y, routing
