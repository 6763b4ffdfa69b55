"""`models.native.qexperts_stacked`: a layer's experts as three stacked block arrays (a GGUF file's expert tensors)
give bit for bit what the same experts as per-expert arrays give, under jit and inside a while_loop, for each
preset's type pair; wrong shapes are a one-line error naming the stacks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import native
from tests.test_native import layer_routing, needs_native


@needs_native
@pytest.mark.parametrize("qgu, qdn", [("q4_k", "q6_k"), ("q8_0", "q8_0")])
def test_stacked_equals_per_expert(qgu, qdn) -> None:
    rng = np.random.default_rng(7)
    T, H, F, E = 6, 256, 256, 5
    gates = [native.random_blocks(rng, qgu, F, H) for _ in range(E)]
    ups = [native.random_blocks(rng, qgu, F, H) for _ in range(E)]
    downs = [native.random_blocks(rng, qdn, H, F) for _ in range(E)]
    stacks = [jnp.asarray(np.stack([q.data for q in qs])) for qs in (gates, ups, downs)]
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
    tokens, weights, offsets = (jnp.asarray(a) for a in layer_routing(rng, T, E, 2, (1,), pad=3))
    per_expert = jax.jit(lambda x: native.qexperts(x, tokens, weights, offsets, list(zip(gates, ups)), downs))(x)

    @jax.jit
    def looped(x, g, u, d):  # the stacks as loop-carried program parameters, as the decode loop passes them
        def body(c):
            i, acc = c
            return i + 1, acc + native.qexperts_stacked(x, tokens, weights, offsets, g, u, d, qgu, qdn)
        return jax.lax.while_loop(lambda c: c[0] < 2, body, (0, jnp.zeros((T, H), jnp.float32)))[1]

    assert np.abs(np.asarray(per_expert)).max() > 0
    np.testing.assert_array_equal(np.asarray(looped(x, *stacks)), 2 * np.asarray(per_expert))
    with pytest.raises(ValueError, match=r"stacked gate, up, down .*expected uint8") as err:
        native.qexperts_stacked(x, tokens, weights, offsets, stacks[0], stacks[1][:, :-1], stacks[2], qgu, qdn)
    assert "\n" not in str(err.value)
