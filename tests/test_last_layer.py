"""A pass that wants only the last token's logits runs its last decoder layer's feed-forward on each row's last token
only (llama.cpp's "skip computing output for unused tokens"), in memory and offloaded alike: the logits are the
full pass's last row, the cache is the full pass's, and the last layer's experts see B rows, not B * S."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conf import compose
from engine.offload.executor import OffloadExecutor, OffloadSettings
from engine.offload.store import ExpertStore
from models.generation import Generator, left_pad
from models.loading import load_model
from models.moe import InMemoryExperts
from models.transformer import build_model, forward, forward_jit, init_cache
from schedulers.base import OFFLOAD, SchedulerSetup, build_scheduler
from schedulers.cost import CostModel
from schedulers.hardware import load_hardware

LENGTHS = (6, 11, 3)  # left padding in every row but one


@pytest.fixture(scope="module")
def models() -> dict:
    """A random tiny Mixtral (4 MoE layers) and the same with its last layer dense."""
    cfg, tiny, _ = load_model(compose("generate", ["model=tiny_mixtral"]).model, seed=2)
    dense_last = build_model(dataclasses.replace(cfg, mlp_only_layers=(cfg.num_hidden_layers - 1,)), seed=3)
    assert dense_last.layers[-1].moe is None and dense_last.layers[0].moe is not None
    return {"moe": tiny, "dense": dense_last}


def _batch(cfg, seed: int = 0) -> tuple[list[list[int]], np.ndarray, np.ndarray, np.ndarray]:
    rs = np.random.RandomState(seed)
    prompts = [rs.randint(3, cfg.vocab_size, n).tolist() for n in LENGTHS]
    tokens, valid = left_pad(prompts, 16, 0)
    positions = np.maximum(np.cumsum(valid, axis=1) - 1, 0).astype(np.int32)
    return prompts, tokens, valid, positions


class RowLog(InMemoryExperts):
    """The in-memory executor, noting the rows each MoE layer's call gets (at trace time: the shapes are static)."""

    layer_free = False  # the log needs the real layer index (no shared layer trace)

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, int]] = []

    __hash__ = object.__hash__  # a static jit argument of its own: a new log traces anew

    def __eq__(self, other: object) -> bool:
        return other is self

    def __call__(self, layer, x, routing, experts):
        self.rows.append((layer, int(x.shape[0])))
        return super().__call__(layer, x, routing, experts)


@pytest.mark.parametrize("last", ["moe", "dense"])
def test_last_only_gives_the_full_pass_last_row_and_cache(models, last: str) -> None:
    model = models[last]
    cfg = model.cfg
    _, tokens, valid, positions = _batch(cfg)
    args = (jnp.asarray(tokens), init_cache(model, len(LENGTHS), 32), jnp.asarray(positions), jnp.asarray(valid))
    full, kv_full, _ = forward_jit(model, *args, empty_cache=True)
    kv_in = init_cache(model, len(LENGTHS), 32)
    last_logits, kv_last, _ = forward_jit(model, args[0], kv_in, args[2], args[3], last_only=True, empty_cache=True)
    assert last_logits.shape == (len(LENGTHS), cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(last_logits), np.asarray(full[:, -1]), rtol=1e-5, atol=1e-5)
    jax.tree.map(np.testing.assert_array_equal, kv_last, kv_full)  # the cache is the attention's: all S tokens
    # eager (no shared layer trace) and the captured pass (full computation, it records every token) agree too
    eager, _, _ = forward(model, args[0], init_cache(model, len(LENGTHS), 32), args[2], args[3], last_only=True,
                          empty_cache=True)
    np.testing.assert_allclose(np.asarray(eager), np.asarray(last_logits), rtol=1e-5, atol=1e-5)


def test_the_last_layer_experts_see_one_row_per_prompt_in_a_prefill(models) -> None:
    model = models["moe"]
    cfg = model.cfg
    _, tokens, valid, positions = _batch(cfg)
    (B, P), last = tokens.shape, cfg.num_hidden_layers - 1

    def rows(capture: bool) -> list[tuple[int, int]]:
        """The rows of each MoE layer's expert call in a prefill as `Generator` runs it (last token's logits)."""
        log = RowLog()
        forward_jit(model, jnp.asarray(tokens), init_cache(model, B, 32), jnp.asarray(positions), jnp.asarray(valid),
                    executor=log, capture=capture, last_only=True, empty_cache=True)
        return log.rows

    assert rows(capture=False) == [(layer, B * P) for layer in cfg.moe_layers[:-1]] + [(last, B)]
    # with routing capture every token is computed (the capture records them all)
    assert rows(capture=True) == [(layer, B * P) for layer in cfg.moe_layers]


@pytest.mark.parametrize("last", ["moe", "dense"])
@pytest.mark.parametrize("fused", [False, True], ids=["layer_by_layer", "fused"])
def test_the_offloaded_prefill_routes_the_last_tokens_only_with_the_in_memory_logits(models, last: str,
                                                                                     fused: bool) -> None:
    model = models[last]
    cfg = model.cfg
    prompts = _batch(cfg, 1)[0]
    ref = Generator(model).forced_logits(prompts, np.zeros((len(prompts), 1), np.int32))[:, 0]
    store = ExpertStore.from_model(model)
    L, E, k = len(cfg.moe_layers), cfg.num_experts, cfg.num_experts_per_tok
    slots = L * E if fused else L
    cost = CostModel(cfg, load_hardware("local_cpu"))
    sched = build_scheduler(OFFLOAD.get("ondemand").settings(use_predictor=False),
                            SchedulerSetup(L, E, k, slots, cost, np.ones((L, E), np.int64)))
    with OffloadExecutor(model, store, sched, cost, OffloadSettings(cache_slots=slots, fuse_resident=fused)) as ex:
        out = ex.generate(prompts, 1)  # the prefill only
        routed = ex.expert_tokens.sum(axis=1)  # the Counter: tokens routed per MoE layer
    assert out.metrics.n_fused_prefill == int(fused)
    np.testing.assert_allclose(out.last_logits, ref, rtol=1e-5, atol=1e-5)
    n_tokens = sum(LENGTHS)
    expected = [n_tokens * k] * L
    if last == "moe":  # the last decoder layer is the last MoE layer: one token per prompt
        expected[-1] = len(prompts) * k
    np.testing.assert_array_equal(routed, expected)
