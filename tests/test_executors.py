"""Every expert-execution strategy of `models.moe` against a plain dense reference (numpy, float64).

The reference computes sum_j weights[t, j] * SwiGLU_{experts[t, j]}(x[t]) token by token; each
strategy must give the same rows for random routings and the edge cases the decode and prefill
paths meet: one token, every token on one expert, unused experts, a token routed twice to the same
expert, padding rows (`Routing.valid` False, whose outputs are unspecified) and, for the grouped
strategy, expert ids outside [0, E) (skipped; the expert-parallel layer relies on it).
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.moe import (InMemoryExperts, RoutedExperts, Routing, experts_dense_skip, experts_grouped,
                        experts_per_slot)

E, H, F = 4, 16, 24


def _weights(seed: int = 0) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rs = np.random.RandomState(seed)
    return ([rs.normal(0, 0.3, (2 * F, H)).astype(np.float32) for _ in range(E)],
            [rs.normal(0, 0.3, (H, F)).astype(np.float32) for _ in range(E)])


def _reference(x: np.ndarray, experts: np.ndarray, weights: np.ndarray, gate_up, down) -> np.ndarray:
    out = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        for e, w in zip(experts[t], weights[t]):
            if not 0 <= e < E:
                continue
            h = gate_up[e].astype(np.float64) @ x[t].astype(np.float64)
            gate, up = h[:F], h[F:]
            out[t] += w * (down[e].astype(np.float64) @ (gate / (1 + np.exp(-gate)) * up))
    return out


def _routing(experts: np.ndarray, weights: np.ndarray, valid: Optional[np.ndarray] = None) -> Routing:
    return Routing(experts=jnp.asarray(experts, jnp.int32), weights=jnp.asarray(weights, jnp.float32),
                   logits=jnp.zeros((experts.shape[0], E), jnp.float32),
                   valid=None if valid is None else jnp.asarray(valid))


def _random_case(T: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rs = np.random.RandomState(seed)
    experts = np.stack([rs.choice(E, k, replace=False) for _ in range(T)])  # E=4 > k: some experts unused
    return experts, rs.uniform(0.1, 1.0, (T, k))


def _cases() -> dict[str, tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]]:
    rs = np.random.RandomState(7)
    cases = {f"random_T{T}_k{k}": (*_random_case(T, k, T * 10 + k), None)
             for T, k in [(1, 1), (1, 2), (5, 2), (16, 2), (37, 3)]}
    cases["all_on_one_expert"] = (np.full((24, 1), 3), rs.uniform(0.1, 1, (24, 1)), None)
    cases["all_on_two_experts"] = (np.tile([[2, 0]], (19, 1)), rs.uniform(0.1, 1, (19, 2)), None)
    cases["same_expert_twice"] = (np.array([[3, 3], [1, 3], [0, 0]]), rs.uniform(0.1, 1, (3, 2)), None)
    cases["small_padding_rows"] = (*_random_case(4, 2, 5), np.array([True, False, True, False]))
    experts, weights = _random_case(12, 2, 3)
    valid = np.ones(12, bool)
    valid[[0, 1, 7]] = False
    cases["padding_rows"] = (experts, weights, valid)
    cases["all_padding"] = (experts, weights, np.zeros(12, bool))  # the same shapes: no new compile
    return cases


CASES = _cases()

STRATEGIES: dict[str, Callable] = {
    "per_slot": experts_per_slot,
    "dense_skip": experts_dense_skip,
    "grouped_default": experts_grouped,
    "grouped_chunk1": lambda x, r, gu, dn: experts_grouped(x, r, gu, dn, chunk=1),
    "grouped_chunk3": lambda x, r, gu, dn: experts_grouped(x, r, gu, dn, chunk=3),
}

JITTED = {name: jax.jit(fn) for name, fn in STRATEGIES.items()}  # one compile per strategy and shape


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_strategy_matches_dense_reference(strategy: str, case: str) -> None:
    experts, weights, valid = CASES[case]
    if strategy == "per_slot" and experts.size > 8:
        pytest.skip("the per-slot switch unrolls T * k branches; it serves a few tokens")
    gate_up, down = _weights()
    x = np.random.RandomState(1).normal(0, 1, (experts.shape[0], H)).astype(np.float32)
    got = np.asarray(JITTED[strategy](jnp.asarray(x), _routing(experts, weights, valid), [jnp.asarray(w) for w in gate_up],
                        [jnp.asarray(w) for w in down]))
    ref = _reference(x, experts, weights, gate_up, down)
    rows = np.ones(len(x), bool) if valid is None else valid
    np.testing.assert_allclose(got[rows], ref[rows], rtol=2e-5, atol=2e-5, err_msg=f"{strategy} on {case}")
    assert np.isfinite(got).all()


def test_grouped_skips_expert_ids_out_of_range() -> None:
    gate_up, down = _weights()
    experts = np.array([[0, E], [E, 2], [E, E], [3, 1]])
    weights = np.random.RandomState(2).uniform(0.1, 1, experts.shape)
    x = np.random.RandomState(3).normal(0, 1, (4, H)).astype(np.float32)
    got = JITTED["grouped_chunk3"](jnp.asarray(x), _routing(experts, weights), [jnp.asarray(w) for w in gate_up],
                                   [jnp.asarray(w) for w in down])
    np.testing.assert_allclose(np.asarray(got), _reference(x, experts, weights, gate_up, down), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("T", [1, 2, 9, 40])
def test_in_memory_executor_every_token_count(T: int) -> None:
    """The default executor (its strategy picked by token count) on the weights of a RoutedExperts module."""
    module = RoutedExperts(E, H, F, rngs=nnx.Rngs(params=0))
    gate_up, down = (list(map(np.asarray, a)) for a in module.arrays())
    experts, weights = _random_case(T, 2, T)
    x = np.random.RandomState(T).normal(0, 1, (T, H)).astype(np.float32)
    got = nnx.jit(lambda m, x, r: InMemoryExperts()(0, x, r, m))(module, jnp.asarray(x), _routing(experts, weights))
    np.testing.assert_allclose(np.asarray(got), _reference(x, experts, weights, gate_up, down), rtol=2e-5, atol=1e-6)


def test_in_memory_executor_needs_weights() -> None:
    with pytest.raises(ValueError, match="layer 3: the model holds no expert weights"):
        InMemoryExperts()(3, jnp.zeros((1, H)), _routing(np.zeros((1, 1)), np.ones((1, 1))), None)
