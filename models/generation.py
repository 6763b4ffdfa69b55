"""Batched generation: one jitted prefill, then the whole decode loop inside one jitted `while_loop`.

Prompts of different lengths share a batch by left padding (every row ends on the same cache
slot; positions count only real tokens). Shapes are bucketed (prompt length, cache length, new
tokens) so a new request shape rarely recompiles and no token ever does. The model is split once
into graphdef + state (the functional NNX pattern), so no Python runs per decoded token.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.memory import release_free_heap
from models.moe import DEFAULT_EXECUTOR, ExpertExecutor
from models.transformer import EXACT_ROUNDING, Captured, KVCache, MoETransformer, forward, init_cache


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; otherwise softmax(logits / temperature) restricted to the top-p nucleus."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


@dataclass
class GenerationOutput:
    """tokens int32 [B, max_new_tokens] (after EOS: the pad id); lengths int [B] (tokens up to and
    including EOS); times in seconds (measured after device completion); captured routing when
    requested: prefill [L, B, P, k] (left-padded prompt columns) and decode [N-1, L, B, k]."""

    tokens: np.ndarray
    lengths: np.ndarray
    prompt_lengths: np.ndarray
    padded_prompt_len: int
    prefill_s: float
    decode_s: float
    prefill_capture: Optional[Captured] = None
    decode_capture: Optional[Captured] = None

    @property
    def decode_tokens(self) -> int:
        """Tokens produced by the decode loop (the first token of each row comes from prefill)."""
        return int(np.maximum(self.lengths - 1, 0).sum())

    def sequences(self) -> list[list[int]]:
        return [row[:n].tolist() for row, n in zip(self.tokens, self.lengths)]


def bucket(n: int, multiple: int = 64) -> int:
    """Round n up to a multiple of `multiple` (at least one multiple)."""
    return max(multiple, -(-n // multiple) * multiple)


def pad_id(pad_token_id: Optional[int], eos_token_id: Optional[int] = None) -> int:
    """The id that fills left padding: the model's pad token, else its eos token, else 0 (padded positions
    are masked, so any id works; these keep the tokens the model would see in HF)."""
    if pad_token_id is not None:
        return int(pad_token_id)
    return int(eos_token_id) if eos_token_id is not None else 0


def left_pad(prompts: Sequence[Sequence[int]], length: int, fill: int) -> tuple[np.ndarray, np.ndarray]:
    """tokens int32 [B, length] and valid bool [B, length], prompts right-aligned after `fill` ids."""
    tokens = np.full((len(prompts), length), fill, np.int32)
    valid = np.zeros((len(prompts), length), bool)
    for i, p in enumerate(prompts):
        if len(p):
            tokens[i, length - len(p):] = np.asarray(p, np.int32)
            valid[i, length - len(p):] = True
    return tokens, valid


def greedy(logits: jax.Array) -> jax.Array:
    """argmax over the last axis (first index of the maximum), int32.

    Written as max + masked min-index: XLA:CPU's fused (value, index) argmax reduction is several times
    slower per wide row than the two plain reductions.
    """
    V = logits.shape[-1]
    best = jnp.max(logits, axis=-1, keepdims=True)
    first = jnp.min(jnp.where(logits == best, jnp.arange(V, dtype=jnp.int32), V), axis=-1)
    return jnp.minimum(first, V - 1).astype(jnp.int32)  # a NaN row has no equal entry


def sample(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_p: jax.Array,
           step: Optional[jax.Array] = None) -> jax.Array:
    """Next tokens int32 [B] from logits [B, V]; temperature <= 0 is greedy (traced values: no recompiles).

    With `step`, the key is `fold_in(key, step)`, derived only on the sampling branch (greedy decode
    skips the PRNG work).
    """

    def nucleus(logits: jax.Array) -> jax.Array:
        k = key if step is None else jax.random.fold_in(key, step)
        logits = logits / temperature
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly better tokens; the best always stays
        sorted_logits = jnp.where(before < top_p, sorted_logits, -jnp.inf)
        kept = jnp.full_like(logits, -jnp.inf).at[jnp.arange(logits.shape[0])[:, None], order].set(sorted_logits)
        return jax.random.categorical(k, kept, axis=-1).astype(jnp.int32)

    return jax.lax.cond(temperature <= 0.0, greedy, nucleus, logits)


def decode_loop(step_fn: Callable[[jax.Array, KVCache, jax.Array, jax.Array], tuple[jax.Array, KVCache, Any]],
                cache: KVCache, first: jax.Array, next_pos: jax.Array, n_steps: jax.Array, eos: jax.Array,
                pad: jax.Array, n_buffer: int, done: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array, Any]:
    """The decode `while_loop` (traced inside a jit): from tokens `first` [B] at positions `next_pos` [B],
    `step_fn(step, cache, tokens [B], positions [B]) -> (next tokens [B], cache, record)` runs until
    `n_steps` steps or every row has produced `eos` (later tokens of a finished row are `pad`; `done`
    [B] marks rows finished before the loop, default `first == eos`).

    Returns (tokens int32 [B, n_buffer + 1] with `first` in column 0, steps run, the step records
    stacked as [n_buffer, ...] (None when `step_fn` records None))."""
    B = first.shape[0]
    out = jnp.full((B, n_buffer + 1), pad, jnp.int32).at[:, 0].set(first)
    record_shape = jax.eval_shape(lambda: step_fn(jnp.int32(0), cache, first, next_pos)[2])
    records = jax.tree.map(lambda a: jnp.zeros((n_buffer,) + a.shape, a.dtype), record_shape)

    def cond(carry: tuple) -> jax.Array:
        step, _, _, _, done, _, _ = carry
        return (step < n_steps) & ~jnp.all(done)

    def body(carry: tuple) -> tuple:
        step, cache, tok, pos, done, out, records = carry
        nxt, cache, record = step_fn(step, cache, tok, pos)
        nxt = jnp.where(done, pad, nxt)
        out = out.at[:, step + 1].set(nxt)
        records = jax.tree.map(lambda buf, r: buf.at[step].set(r), records, record)
        return step + 1, cache, nxt, pos + 1, done | (nxt == eos), out, records

    done = first == eos if done is None else done
    carry = (jnp.zeros((), jnp.int32), cache, first, next_pos, done, out, records)
    step, _, _, _, _, out, records = jax.lax.while_loop(cond, body, carry)
    return out, step, records


class Generator:
    """Compiled prefill + decode loop for one model and expert executor."""

    def __init__(self, model: MoETransformer, executor: ExpertExecutor = DEFAULT_EXECUTOR,
                 cache_dtype: Any = None, capture: bool = False, capture_hidden: bool = False,
                 prompt_bucket: int = 16, cache_bucket: int = 64, compiler_options: Optional[dict] = None):
        self.cfg = model.cfg
        self.graphdef, self.state = nnx.split(model)
        self.executor = executor
        self.cache_dtype = cache_dtype or model.run_dtype
        self.capture, self.capture_hidden = capture, capture_hidden
        self.prompt_bucket, self.cache_bucket = prompt_bucket, cache_bucket
        opts = dict(EXACT_ROUNDING if compiler_options is None else compiler_options)
        self._prefill = jax.jit(self._prefill_impl, donate_argnames=("cache",), compiler_options=opts)
        self._decode = jax.jit(self._decode_impl, static_argnames=("n_buffer",), compiler_options=opts)
        self._forced = jax.jit(self._forced_impl, donate_argnames=("cache",), compiler_options=opts)

    # ---- compiled pieces --------------------------------------------------------------------
    def _model(self, state: Any) -> MoETransformer:
        return nnx.merge(self.graphdef, state)

    def _prefill_impl(self, state: Any, cache: KVCache, tokens: jax.Array, valid: jax.Array, key: jax.Array,
                      params: jax.Array) -> tuple[jax.Array, jax.Array, KVCache, Optional[Captured]]:
        positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0).astype(jnp.int32)
        logits, cache, captured = forward(self._model(state), tokens, cache, positions, valid,
                                          executor=self.executor, capture=self.capture,
                                          capture_hidden=self.capture_hidden, last_only=True,
                                          empty_cache=True)  # `generate` prefills a fresh cache
        first = sample(logits, key, params[0], params[1])
        return first, positions[:, -1] + 1, cache, captured

    def _decode_impl(self, state: Any, cache: KVCache, first: jax.Array, next_pos: jax.Array, n_steps: jax.Array,
                     eos: jax.Array, pad: jax.Array, key: jax.Array, params: jax.Array, n_buffer: int
                     ) -> tuple[jax.Array, jax.Array, Optional[Captured]]:
        model = self._model(state)

        def step_fn(step: jax.Array, cache: KVCache, tok: jax.Array, pos: jax.Array) -> tuple:
            logits, cache, captured = forward(model, tok[:, None], cache, pos[:, None], executor=self.executor,
                                              capture=self.capture, capture_hidden=self.capture_hidden,
                                              last_only=True)
            record = None if captured is None else Captured(
                experts=captured.experts[:, :, 0], weights=captured.weights[:, :, 0],
                hidden=None if captured.hidden is None else captured.hidden[:, :, 0].astype(self.cache_dtype))
            return sample(logits, key, params[0], params[1], step=step), cache, record

        return decode_loop(step_fn, cache, first, next_pos, n_steps, eos, pad, n_buffer)

    def _forced_impl(self, state: Any, cache: KVCache, tokens: jax.Array, valid: jax.Array, forced: jax.Array
                     ) -> jax.Array:
        model = self._model(state)
        positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0).astype(jnp.int32)
        first, cache, _ = forward(model, tokens, cache, positions, valid, executor=self.executor, last_only=True,
                                  empty_cache=True)

        def step(carry: tuple, tok: jax.Array) -> tuple:
            cache, pos = carry
            logits, cache, _ = forward(model, tok[:, None], cache, pos[:, None], executor=self.executor, last_only=True)
            return (cache, pos + 1), logits

        _, rest = jax.lax.scan(step, (cache, positions[:, -1] + 1), forced[:, :-1].T)
        return jnp.concatenate([first[None], rest], axis=0).transpose(1, 0, 2)

    # ---- public -----------------------------------------------------------------------------------
    def forced_logits(self, prompts: Sequence[Sequence[int]], forced: np.ndarray,
                      pad_token_id: Optional[int] = None) -> np.ndarray:
        """Teacher-forced logits float32 [B, N, V] for forced int [B, N]: after the prompt, then after each of
        forced[:, :N-1] fed in turn (decode steps, as generation runs them)."""
        prompts = [list(map(int, p)) for p in prompts]
        forced = np.asarray(forced, np.int32)
        self._check(prompts, forced.shape[1])
        P = bucket(max(len(p) for p in prompts), self.prompt_bucket)
        tokens, valid = left_pad(prompts, P, pad_id(pad_token_id))
        cache = init_cache(self._model(self.state), len(prompts), bucket(P + forced.shape[1], self.cache_bucket),
                           self.cache_dtype)
        return np.asarray(self._forced(self.state, cache, jnp.asarray(tokens), jnp.asarray(valid), jnp.asarray(forced)))

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 sampling: SamplingParams = SamplingParams(), eos_token_id: Optional[int] = None,
                 pad_token_id: Optional[int] = None) -> GenerationOutput:
        """Generate up to `max_new_tokens` per prompt (stopping a row at `eos_token_id` when given)."""
        prompts = [list(map(int, p)) for p in prompts]
        self._check(prompts, max_new_tokens)
        pad = pad_id(pad_token_id, eos_token_id)
        eos = -1 if eos_token_id is None else int(eos_token_id)
        P = bucket(max(len(p) for p in prompts), self.prompt_bucket)
        capacity = bucket(P + max_new_tokens, self.cache_bucket)
        tokens, valid = left_pad(prompts, P, pad)
        key = jax.random.PRNGKey(sampling.seed)
        params = jnp.asarray([sampling.temperature, sampling.top_p], jnp.float32)  # [temperature, top_p]
        cache = init_cache(self._model(self.state), len(prompts), capacity, self.cache_dtype)
        t0 = time.perf_counter()
        first, next_pos, cache, pre_cap = self._prefill(self.state, cache, jnp.asarray(tokens), jnp.asarray(valid),
                                                        jax.random.fold_in(key, 1 << 30), params)
        first.block_until_ready()
        t1 = time.perf_counter()
        n_buffer = bucket(max(max_new_tokens - 1, 1), 32)
        out, steps, dec_cap = self._decode(self.state, cache, first, next_pos, jnp.int32(max_new_tokens - 1),
                                           jnp.int32(eos), jnp.int32(pad), key, params, n_buffer=n_buffer)
        out = np.asarray(jax.device_get(out))[:, :max_new_tokens]
        t2 = time.perf_counter()
        self._trim_after_compile()
        return GenerationOutput(tokens=out, lengths=self._lengths(out, eos), prompt_lengths=np.array([len(p) for p in prompts]),
                                padded_prompt_len=P, prefill_s=t1 - t0, decode_s=t2 - t1,
                                prefill_capture=jax.device_get(pre_cap) if pre_cap is not None else None,
                                decode_capture=_trim(jax.device_get(dec_cap), int(steps)) if dec_cap is not None else None)

    def _trim_after_compile(self) -> None:
        """After a call that compiled a new program, give XLA's freed compile-time heap back to the system: glibc keeps
        it as anonymous memory otherwise (Qwen3-30B-A3B-shaped, 8 narrow layers: 0.39 GB of growth, 0.20 GB of it freed
        heap; at full depth the programs' compile grew RssAnon by ~1.3 GB per batch size)."""
        compiled = self._prefill._cache_size() + self._decode._cache_size()
        if compiled != getattr(self, "_compiled", 0):
            self._compiled = compiled
            release_free_heap()

    def _check(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        if not prompts:
            raise ValueError("generate: empty batch (no prompts)")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"generate: prompt {i} is empty")
            bad = [t for t in p if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise ValueError(f"generate: prompt {i} holds token ids {bad[:5]} outside [0, {self.cfg.vocab_size})")
        if max_new_tokens < 1:
            raise ValueError(f"generate: max_new_tokens must be >= 1, got {max_new_tokens}")
        longest = max(len(p) for p in prompts)
        if longest + max_new_tokens > self.cfg.max_position_embeddings:
            raise ValueError(f"generate: prompt of {longest} tokens + max_new_tokens={max_new_tokens} exceeds the "
                             f"model's context (max_position_embeddings={self.cfg.max_position_embeddings})")

    @staticmethod
    def _lengths(tokens: np.ndarray, eos: int) -> np.ndarray:
        hit = tokens == eos
        first = np.where(hit.any(axis=1), hit.argmax(axis=1) + 1, tokens.shape[1])
        return first.astype(np.int64)


def _trim(captured: Captured, steps: int) -> Captured:
    return dataclasses.replace(captured, experts=captured.experts[:steps], weights=captured.weights[:steps],
                               hidden=None if captured.hidden is None else captured.hidden[:steps])
