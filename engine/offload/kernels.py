"""The jitted pieces the offload executor calls, fused so that a MoE layer costs two device calls.

Per MoE layer the executor needs the router's output on the host before it can plan, so the
forward pass is cut at every gate: `front` runs attention + post-norm + router of the first MoE
layer; `back_front` finishes MoE layer l (its expert outputs, shared experts, residual) and runs
the next MoE layer's attention and router in the same call; `back` finishes the last one. Dense
decoder layers (DeepSeek's first) are `dense` calls. A prefill's last decoder layer (`front`, `back_front` or
`dense` with `last_rows`) keeps each row's last token after its attention, as `models.transformer.forward` does:
the pass wants only the last logits, so that layer's router, experts and residual run on B rows, not B * S.
Device experts (`experts`) index the slots of the expert cache: a pair whose slot index is -1 (a CPU expert, a
padding row, an expert computed elsewhere) carries weight 0 and contributes nothing.

When every routed expert is in the cache and the scheduler would plan nothing but device work,
`resident_pass` runs a whole forward pass as one call over the cache slots (the executor's fast
path: no plan to make, so no reason to stop at the gates).

Sub-modules of the same kind share one NNX graphdef across layers; the compiled functions close
over the graphdefs and take parameters as plain dicts of arrays (cheap to flatten), and are cached
per (config, graphdefs, expert executor), so every executor of the same model reuses them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import ModelConfig
from models.generation import bucket, decode_loop
from models.quant.dense import embed_lookup, tied_head
from models.moe import DEFAULT_EXECUTOR, ExpertExecutor, Routing
from models.quant.blocks import QuantArray, block_type
from models.transformer import EXACT_ROUNDING, KVCache, MoETransformer, attention_inputs, model_rope, trims_last_layer


class SlotExperts:
    """Duck-typed `RoutedExperts` over cache slots, for the model's expert executors."""

    def __init__(self, gate_up: list[jax.Array], down: list[jax.Array]):
        self.gate_up, self.down = gate_up, down

    @property
    def num_experts(self) -> int:
        return len(self.gate_up)

    def arrays(self) -> tuple[list[jax.Array], list[jax.Array]]:
        return self.gate_up, self.down


class _Head(nnx.Module):
    """Final norm + LM head of a model as one module (sharing the model's parameters)."""

    def __init__(self, model: MoETransformer):
        self.norm = model.norm
        self.lm_head = model.lm_head
        self.embed = model.embed if model.lm_head is None else None

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.norm(x)
        out = tied_head(h, self.embed[...]) if self.lm_head is None else self.lm_head(h)
        return out.astype(jnp.float32)


@dataclass(frozen=True)
class _Defs:
    cfg: ModelConfig
    attn: tuple  # graphdefs of (input norm, attention, post norm)
    router: Any
    mlp: Any
    shared: Any
    head: Any
    executor: ExpertExecutor
    formats: Optional[tuple] = None  # per MoE layer its LayerFormat, for quantized experts (slots hold block bytes)
    dtype: Any = None  # the run dtype (an embedding kept in blocks is dequantized to it)


@dataclass(frozen=True)
class _Fns:
    prepare: Callable
    embed: Callable
    front: Callable
    back_front: Callable
    back: Callable
    dense: Callable
    experts: Callable
    head: Callable
    resident_pass: Callable
    resident_decode: Callable


_COMPILED: dict[_Defs, _Fns] = {}


def _build(d: _Defs) -> _Fns:
    rope = model_rope(d.cfg)

    def merge(gd: Any, state: dict) -> Any:
        return nnx.merge(gd, nnx.State(state))

    def attend(states: tuple, x: jax.Array, ai: Any, layer_cache: dict, last_rows: bool = False
               ) -> tuple[jax.Array, dict, jax.Array]:
        """`last_rows`: the feed-forward that follows runs on each row's last token only (x, g [B, 1, H]), as
        `models.transformer.forward` runs a prefill's last layer (`trims_last_layer`)."""
        n_in, attn, n_post = (merge(gd, s) for gd, s in zip(d.attn, states))
        h, layer_cache = attn(n_in(x), ai, layer_cache, rope)
        x = x + h
        if last_rows:
            x = x[:, -1:]
        return x, layer_cache, n_post(x)

    def route(router: dict, g: jax.Array) -> tuple[jax.Array, jax.Array]:
        B, S, H = g.shape
        r = merge(d.router, router)(g.reshape(B * S, H))
        return r.experts, r.weights

    def finish(x: jax.Array, g: jax.Array, parts: list, shared: Optional[dict]) -> jax.Array:
        """The layer's output from its float32 expert parts, rounded where the in-memory MoE block rounds."""
        B, S, H = x.shape
        y = parts[0]
        for p in parts[1:]:
            y = y + p
        y = y.reshape(B, S, H).astype(x.dtype)
        if shared is not None:
            y = y + merge(d.shared, shared)(g)
        return x + y

    def front(states: tuple, router: dict, x: jax.Array, ai: Any, layer_cache: dict, last_rows: bool = False
              ) -> tuple:
        x, layer_cache, g = attend(states, x, ai, layer_cache, last_rows)
        return (x, layer_cache, g) + route(router, g)

    def back_front(x: jax.Array, g: jax.Array, parts: list, shared: Optional[dict], states: tuple, router: dict,
                   ai: Any, layer_cache: dict, last_rows: bool = False) -> tuple:
        return front(states, router, finish(x, g, parts, shared), ai, layer_cache, last_rows)

    def dense(states: tuple, mlp: dict, x: jax.Array, ai: Any, layer_cache: dict, last_rows: bool = False
              ) -> tuple[jax.Array, dict]:
        x, layer_cache, g = attend(states, x, ai, layer_cache, last_rows)
        return x + merge(d.mlp, mlp)(g), layer_cache

    def quantized(fmt: Any, gate_up: list, down: list) -> tuple[list, list]:
        """Slots holding experts of block types `fmt` (a LayerFormat) as QuantArrays (a slot's first row bytes hold
        the blocks)."""
        H, F = d.cfg.hidden_size, d.cfg.expert_intermediate_size
        gu_w, dn_w = block_type(fmt.gate_up).row_bytes(H), block_type(fmt.down).row_bytes(F)

        def rows(a: jax.Array, width: int) -> jax.Array:  # a slot at its expert's width goes to the kernel as it is
            return a if a.shape[1] == width else a[:, :width]

        return ([QuantArray(rows(a, gu_w), fmt.gate_up, (2 * F, H)) for a in gate_up],
                [QuantArray(rows(a, dn_w), fmt.down, (H, F)) for a in down])

    def experts(g: jax.Array, slot_idx: jax.Array, weights: jax.Array, gate_up: list, down: list,
                fmt: Any = None) -> jax.Array:
        """`fmt` (static): the layer's `LayerFormat` for quantized slots, else None. Keyed by the block types, not the
        layer, so layers of one format share one compiled program (a 48-layer model compiled 48 of them)."""
        if fmt is not None:
            gate_up, down = quantized(fmt, gate_up, down)
        B, S, H = g.shape
        live = slot_idx >= 0
        # a pair routed nowhere (-1: a CPU expert, a padding row) stays out of range, so the grouped kernels leave
        # it out: mapped to slot 0 it would join that expert's rows, and a row's sums depend on its group's size
        routing = Routing(experts=slot_idx.astype(jnp.int32),
                          weights=jnp.where(live, weights, 0.0).astype(jnp.float32),
                          logits=jnp.zeros((B * S, 1), jnp.float32))
        return d.executor(-1, g.reshape(B * S, H), routing, SlotExperts(gate_up, down))

    def head(head_state: dict, x_last: jax.Array) -> jax.Array:
        return merge(d.head, head_state)(x_last)

    def resident_forward(params: dict, gate_up: tuple, down: tuple, kv: KVCache, tokens: jax.Array,
                         positions: jax.Array, valid: jax.Array, empty_cache: bool = False
                         ) -> tuple[jax.Array, KVCache, tuple]:
        """One forward pass, expert e of MoE layer m at gate_up[m][e] / down[m][e]: (last logits, kv,
        experts routed per MoE layer [B*S, k], the last decoder layer's [B, k] when it runs on the last tokens only:
        `trims_last_layer`). `empty_cache`: a prefill into a fresh cache (as `models.forward`'s)."""
        ai, kv = attention_inputs(d.cfg, kv, positions, valid, empty_cache)
        x = embed_lookup(params["embed"], tokens, d.dtype)
        layers, routed = list(kv.layers), []
        trim = trims_last_layer(True, False, tokens.shape[1])
        for i in range(d.cfg.num_hidden_layers):  # nested jits: each piece traced once per structure, not per layer
            last_rows = trim and i == d.cfg.num_hidden_layers - 1
            live = (valid[:, -1:] if last_rows else valid).reshape(-1, 1)
            if i not in d.cfg.moe_layers:
                x, layers[i] = dense_j(params["attn"][i], params["mlp"][i], x, ai, layers[i], last_rows)
                continue
            m = len(routed)
            x, layers[i], g, chosen, weights = front_j(params["attn"][i], params["router"][i], x, ai, layers[i],
                                                       last_rows)
            y = experts_j(g, jnp.where(live, chosen, -1), weights, list(gate_up[m]), list(down[m]),
                          fmt=None if d.formats is None else d.formats[m])
            x = finish_j(x, g, [y], params["shared"].get(i))
            routed.append(chosen)
        kv = KVCache(layers=layers, valid=kv.valid, positions=kv.positions, index=kv.index + tokens.shape[1])
        return head(params["head"], x[:, -1]), kv, tuple(routed)

    def resident_decode(params: dict, gate_up: tuple, down: tuple, kv: KVCache, first: jax.Array,
                        next_pos: jax.Array, done: jax.Array, n_steps: jax.Array, eos: jax.Array, pad: jax.Array,
                        n_buffer: int, keep_logits: bool) -> tuple[jax.Array, jax.Array, tuple]:
        """Greedy decode steps of `resident_forward` in one loop: (tokens [B, n_buffer + 1], steps run,
        (experts routed [n_buffer, L, B, k], last logits [n_buffer, B, V] or None))."""
        valid = jnp.ones((first.shape[0], 1), bool)

        def step_fn(step: jax.Array, kv: KVCache, tok: jax.Array, pos: jax.Array) -> tuple:
            logits, kv, routed = resident_forward(params, gate_up, down, kv, tok[:, None], pos[:, None], valid)
            return jnp.argmax(logits, -1).astype(jnp.int32), kv, (jnp.stack(routed), logits if keep_logits else None)

        return decode_loop(step_fn, kv, first, next_pos, n_steps, eos, pad, n_buffer, done=done)

    rows = functools.partial(jax.jit, static_argnames=("last_rows",))
    front_j, dense_j, finish_j = rows(front), rows(dense), jax.jit(finish)  # called inside resident_forward
    experts_j = jax.jit(experts, static_argnames=("fmt",))
    jit = functools.partial(jax.jit, compiler_options=EXACT_ROUNDING)  # the rounding of the in-memory model
    def prepare(cache: KVCache, pos: jax.Array, valid: jax.Array, empty_cache: bool = False) -> tuple[Any, KVCache]:
        return attention_inputs(d.cfg, cache, pos, valid, empty_cache)

    return _Fns(prepare=jit(prepare, static_argnames=("empty_cache",)),
                embed=jit(lambda table, tokens: embed_lookup(table, tokens, d.dtype)),
                front=jit(front, static_argnames=("last_rows",)),
                back_front=jit(back_front, static_argnames=("last_rows",)), back=jit(finish),
                dense=jit(dense, static_argnames=("last_rows",)), experts=jit(experts, static_argnames=("fmt",)),
                head=jit(head), resident_pass=jit(resident_forward, donate_argnames=("kv",), static_argnames=("empty_cache",)),
                resident_decode=jit(resident_decode, static_argnames=("n_buffer", "keep_logits")))


def _pure(module: nnx.Module) -> tuple[Any, dict]:
    gd, state = nnx.split(module)
    return gd, nnx.to_pure_dict(state)


class LayerKernels:
    """The device calls of one model's offloaded forward pass (see the module docstring)."""

    def __init__(self, model: MoETransformer, expert_executor: ExpertExecutor = DEFAULT_EXECUTOR,
                 formats: Optional[tuple] = None):
        """`formats`: per MoE layer the block types of quantized experts (`ExpertStore.formats`), else None."""
        self.cfg = model.cfg
        layers = list(model.layers)
        moe = [l for l in layers if l.is_moe]
        dense = [l for l in layers if not l.is_moe]
        shared = [l for l in moe if l.moe.shared is not None]
        self.attn = [tuple(_pure(m)[1] for m in (l.input_norm, l.attn, l.post_norm)) for l in layers]
        self.router = {l.index: _pure(l.moe.router)[1] for l in moe}
        self.shared = {l.index: _pure(l.moe.shared)[1] for l in shared}
        self.mlp = {l.index: _pure(l.mlp)[1] for l in dense}
        head_def, self.head = _pure(_Head(model))
        self.embed = model.embed[...]
        self.params = {"embed": self.embed, "attn": self.attn, "router": self.router, "mlp": self.mlp,
                       "shared": self.shared, "head": self.head}
        defs = _Defs(cfg=model.cfg, attn=tuple(_pure(m)[0] for m in (layers[0].input_norm, layers[0].attn,
                                                                       layers[0].post_norm)),
                     router=_pure(moe[0].moe.router)[0] if moe else None, mlp=_pure(dense[0].mlp)[0] if dense else None,
                     shared=_pure(shared[0].moe.shared)[0] if shared else None, head=head_def,
                     executor=expert_executor, formats=formats, dtype=model.run_dtype)
        if defs not in _COMPILED:
            _COMPILED[defs] = _build(defs)
        self.fns = _COMPILED[defs]
        self.formats = formats

    def prepare(self, cache: KVCache, positions: jax.Array, valid: jax.Array, empty_cache: bool = False
                ) -> tuple[Any, KVCache]:
        """Attention inputs of the new tokens (`empty_cache`: a prefill into a fresh cache attends them only, the
        in-memory model's program: `models.transformer.forward`)."""
        return self.fns.prepare(cache, positions, valid, empty_cache=empty_cache)

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        return self.fns.embed(self.embed, tokens)

    def front(self, layer: int, x: jax.Array, ai: Any, layer_cache: dict, last_rows: bool = False) -> tuple:
        """(x, layer cache, gate input g, experts [T, k], weights [T, k]) of MoE layer `layer`; with `last_rows`
        x and g hold each row's last token only (T = B: a prefill's last layer, `trims_last_layer`)."""
        return self.fns.front(self.attn[layer], self.router[layer], x, ai, layer_cache, last_rows=last_rows)

    def back_front(self, done: int, x: jax.Array, g: jax.Array, parts: list, layer: int, ai: Any,
                   layer_cache: dict, last_rows: bool = False) -> tuple:
        """Finish MoE layer `done`, then `front` of MoE layer `layer`, in one call."""
        return self.fns.back_front(x, g, parts, self.shared.get(done), self.attn[layer], self.router[layer], ai,
                                   layer_cache, last_rows=last_rows)

    def back(self, done: int, x: jax.Array, g: jax.Array, parts: list) -> jax.Array:
        return self.fns.back(x, g, parts, self.shared.get(done))

    def dense(self, layer: int, x: jax.Array, ai: Any, layer_cache: dict, last_rows: bool = False
              ) -> tuple[jax.Array, dict]:
        return self.fns.dense(self.attn[layer], self.mlp[layer], x, ai, layer_cache, last_rows=last_rows)

    def experts(self, g: jax.Array, slot_idx: Any, weights: Any, gate_up: list, down: list,
                layer: Optional[int] = None) -> jax.Array:
        """Device experts over cache slots; `layer` (the MoE layer) only matters for quantized slots."""
        if self.formats and layer is None:
            raise ValueError("LayerKernels.experts: quantized slots need their MoE layer (its block types)")
        return self.fns.experts(g, slot_idx, weights, gate_up, down, fmt=self.formats[layer] if self.formats else None)

    def logits(self, x_last: jax.Array) -> jax.Array:
        return self.fns.head(self.head, x_last)

    def resident_pass(self, gate_up: tuple, down: tuple, kv: KVCache, tokens: jax.Array, positions: jax.Array,
                      valid: jax.Array, empty_cache: bool = False) -> tuple[jax.Array, KVCache, tuple]:
        """A whole forward pass in one call (every routed expert resident; `kv` is donated): gate_up[m][e],
        down[m][e] hold expert e of MoE layer m. Returns (logits of the last position [B, V], kv,
        experts routed per MoE layer, int32 [B*S, k], or [B, k] at a last decoder layer run on the last tokens
        only). `empty_cache`: a prefill into a fresh cache."""
        return self.fns.resident_pass(self.params, gate_up, down, kv, tokens, positions, valid, empty_cache=empty_cache)

    def resident_decode(self, gate_up: tuple, down: tuple, kv: KVCache, first: np.ndarray, next_pos: np.ndarray,
                        done: np.ndarray, n_steps: int, eos: int, pad: int, keep_logits: bool
                        ) -> tuple[jax.Array, jax.Array, tuple]:
        """Up to `n_steps` greedy decode steps over a full cache in one call (`kv` is consumed), from tokens
        `first` [B] at positions `next_pos` [B], rows `done` [B] emitting `pad`: (tokens [B, n + 1] with
        `first` in column 0, steps run, (experts routed [n, L, B, k], logits [n, B, V] or None)), n >= n_steps."""
        return self.fns.resident_decode(self.params, gate_up, down, kv, first, next_pos, done, np.int32(n_steps),
                                        np.int32(eos), np.int32(pad), n_buffer=bucket(max(n_steps, 1), 32),
                                        keep_logits=keep_logits)
