"""A deeper model compiles like a shallow one: `models.transformer.forward` traces one layer of each structure and
calls it from every layer (and the offload executor's fused pass does the same), so the program the model's jit
lowers does not grow with depth, and the tokens are those of the unrolled program."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import moe
from models.generation import Generator
from models.loading import load_model

from tests.test_full_depth_gguf import TINY_QWEN
from engine.bench import full_depth_gguf as fd


@pytest.fixture(scope="module")
def qwen_files(tmp_path_factory):
    """Tiny Qwen3 Q4_K_M GGUFs (experts and dense projections in blocks) of 4 and 6 layers: both have Q4_K_M's two
    layer structures (Q6_K or Q4_K down / attn_v), A A B B and A A B A A B. A prefill runs its last layer's
    feed-forward on the last tokens only (`trims_last_layer`): its programs trace full A, full B and the last B
    alike; a 2- or 3-layer model (A B, A A B) has no full-width B."""
    folder = tmp_path_factory.mktemp("share")
    out = {}
    for layers in (4, 6):
        path = folder / f"qwen-L{layers}.gguf"
        fd.write(fd.model_config("qwen3_moe", layers, **TINY_QWEN), "q4_k_m", path, drop_cache=False)
        out[layers] = load_model({"checkpoint": str(path), "arch": None, "name": "tiny"}, dtype=jnp.bfloat16)[1]
    return out


def lowered_ops(model, op: str) -> int:
    """Occurrences of `op` in the StableHLO of the generator's prefill for a batch of 2 prompts of 16 tokens."""
    gen = Generator(model)
    from models.transformer import init_cache

    tokens = jnp.full((2, 16), 7, jnp.int32)
    valid = jnp.ones((2, 16), bool)
    cache = init_cache(model, 2, 64, jnp.bfloat16)
    text = gen._prefill.lower(gen.state, cache, tokens, valid, jax.random.PRNGKey(0),
                              jnp.zeros((2,), jnp.float32)).as_text()
    return text.count(op)


def test_lowered_program_does_not_grow_with_depth(qwen_files, monkeypatch) -> None:
    def ops(n: int) -> int:
        return lowered_ops(qwen_files[n], "stablehlo.dot_general") + lowered_ops(qwen_files[n], "custom_call")

    shallow, deep = ops(4), ops(6)
    assert shallow > 0 and deep == shallow, (shallow, deep)
    # the unrolled program (an executor that needs the layer index) has every layer's ops: it grows by a layer's
    monkeypatch.setattr(moe.InMemoryExperts, "layer_free", False)
    unrolled_shallow, unrolled_deep = ops(4), ops(6)
    assert unrolled_deep > unrolled_shallow >= deep, (unrolled_shallow, unrolled_deep, deep)


@pytest.mark.slow
def test_shared_layers_give_the_unrolled_logits(qwen_files, monkeypatch) -> None:
    """Teacher-forced logits (prefill, then decode steps) bit for bit those of the unrolled program."""
    model = qwen_files[4]
    prompts = [[5, 9, 300, 41, 8], [17, 2, 90]]
    forced = np.array([[11, 12, 13], [14, 15, 16]])
    shared = Generator(model).forced_logits(prompts, forced)
    monkeypatch.setattr(moe.InMemoryExperts, "layer_free", False)
    unrolled = Generator(model).forced_logits(prompts, forced)
    assert np.isfinite(shared).all() and np.abs(shared).max() > 0
    np.testing.assert_array_equal(shared, unrolled)


@pytest.mark.slow
def test_offloaded_experts_compile_once_per_block_format(qwen_files) -> None:
    """The offload executor's device experts over quantized slots compile per layer format (Q4_K_M: Q4_K or Q6_K
    down), not per layer: the 6-layer model compiles as many expert programs as the 4-layer one (both have the two
    formats); tokens those of the in-memory run."""
    from engine.offload.executor import OffloadExecutor, OffloadSettings
    from engine.offload.store import ExpertStore
    from schedulers.base import OFFLOAD, SchedulerSetup, build_scheduler
    from schedulers.cost import CostModel
    from schedulers.hardware import load_hardware

    prompts = [[5, 9, 300, 41, 8], [17, 2, 90]]
    compiled = {}
    for layers, model in qwen_files.items():
        cfg = model.cfg
        ref = Generator(model).generate(prompts, 4)
        store = ExpertStore.from_model(model)
        assert len(set(store.formats.values())) == 2
        L, E = len(cfg.moe_layers), cfg.num_experts
        cost = CostModel(cfg, load_hardware("local_cpu"), expert_bytes=store.expert_bytes)
        sched = build_scheduler(OFFLOAD.get("ondemand").settings(label="ondemand"),
                                SchedulerSetup(L, E, cfg.num_experts_per_tok, 2 * L, cost, np.zeros((L, E), int)))
        with OffloadExecutor(model, store, sched, cost, OffloadSettings(cache_slots=2 * L)) as ex:
            out = ex.generate(prompts, 4)
            compiled[layers] = ex.kernels.fns.experts._cache_size()
        np.testing.assert_array_equal(out.tokens, ref.tokens)
    # per layer it would be >= 12 (6 layers x prefill and decode shapes); one program more than the 4-layer model's
    # at most: the executor hands the experts a hidden state that is committed to the device or not depending on the
    # call that produced it (a jit cache key of its own, whatever the depth)
    assert compiled[6] <= compiled[4] + 1 and compiled[6] < 8, compiled
