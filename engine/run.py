"""`python -m engine.run`: the main job. Offloaded MoE inference (LayerScope) of a model serving a workload.

    python -m engine.run                                          # the embedded default, about a minute
    python -m engine.run scheduler=hybrimoe offload.budget_fraction=0.5 workload.batch_size=16
    python -m engine.run -m scheduler=presched,hybrimoe,fiddler,ondemand     # compare systems
    python -m engine.run model.checkpoint=/path/to/hf_folder model.arch=null hardware=a100_pcie4

Flow: load the model (routed experts to host memory only), build the hot-expert table from
`profile_batches` served first (the Counter), size the device expert cache from the budget, then
serve the workload's batches with the offload executor; optionally serve them again with the
plain in-memory model to check the tokens are identical and to measure the machinery's cost.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import jax.numpy as jnp
import numpy as np
from omegaconf import DictConfig, OmegaConf

from conf import hydra_main, to_frozen
from conf.schemas.hardware import HardwareProfile
from conf.schemas.run import OffloadConfig, RunConfig
from engine.calibrate import device_memory_gib
from engine.offload.cache import slots_for_budget
from engine.offload.executor import OffloadExecutor, OffloadOutput, OffloadSettings, padded_shapes
from engine.offload.store import ExpertStore
from engine.recording import record_generation, trace_meta
from engine.sim.timeline import plot_timeline
from engine.telemetry import Telemetry
from engine.trace import TraceRecorder
from engine.workloads import PromptSampler, build_workload
from models.config import ModelConfig
from models.generation import Generator
from models.hf import load_hf
from models.loading import load_model, load_tokenizer, resolve_model_config
from predictors import load_predictor
from predictors.base import Predictor
from schedulers.base import SchedulerSettings, SchedulerSetup, build_scheduler
from schedulers.cost import CostModel


def cache_slots(cfg: ModelConfig, offload: OffloadConfig, expert_bytes: int) -> int:
    """Expert-cache slots of the configured budget; a clear error when it cannot run or exceeds the device."""
    total = cfg.num_experts * len(cfg.moe_layers)
    budget_bytes = offload.budget_bytes
    budget_experts = offload.budget_experts
    given = [k for k, v in (("budget_fraction", offload.budget_fraction), ("budget_experts", budget_experts),
                            ("budget_bytes", budget_bytes)) if v is not None]
    if len(given) != 1:
        raise ValueError(f"offload: set exactly one of budget_fraction / budget_experts / budget_bytes (got {given}); "
                         "e.g. offload.budget_fraction=null offload.budget_experts=16")
    if offload.budget_fraction is not None:
        if not 0 < offload.budget_fraction <= 1:
            raise ValueError(f"offload.budget_fraction: must lie in (0, 1], got {offload.budget_fraction}")
        budget_experts = max(int(round(offload.budget_fraction * total)), 0)
    device_bytes = device_memory_gib() * 2**30
    wanted = budget_bytes if budget_bytes is not None else budget_experts * expert_bytes
    if wanted > device_bytes:
        raise ValueError(f"offload budget of {wanted / 2**30:.2f} GiB exceeds the device's {device_bytes / 2**30:.2f} GiB")
    try:
        return slots_for_budget(budget_bytes, budget_experts, expert_bytes, offload.staging_slots, total)
    except ValueError as exc:
        raise ValueError(f"{exc}; the smallest runnable budget is offload.budget_experts={offload.staging_slots}") from None


def load_offload_model(node: Any, dtype: Any, seed: int) -> tuple[ModelConfig, Any, ExpertStore, Any, Optional[Any]]:
    """(config, model without device experts, expert store, tokenizer, full in-memory model or None)."""
    cfg = resolve_model_config(node.model)
    np_dtype = np.dtype(jnp.dtype(dtype))
    if node.model.get("checkpoint") is None:
        _, full, folder = load_model(node.model, dtype=dtype, seed=seed)
        return cfg, full, ExpertStore.from_model(full, np_dtype), load_tokenizer(folder), full
    _, model, folder = load_model(node.model, dtype=dtype, seed=seed, with_experts=False)
    store = ExpertStore.from_checkpoint(folder, cfg, np_dtype)
    full = load_hf(folder, dtype=dtype)[1] if node.compare_in_memory else None
    return cfg, model, store, load_tokenizer(folder), full


def reference_trace(full: Any, cfg: ModelConfig, batches: list, name: str) -> tuple[Any, dict[tuple[int, int], int]]:
    """Routing of the in-memory model on the same batches (the oracle predictor replays it) + a (seq, pos) index."""
    recorder = TraceRecorder(trace_meta(cfg, name, "engine.run reference"))
    gen = Generator(full, capture=True)
    seq = 0
    for batch in batches:
        prompts = batch.token_lists()
        out = gen.generate(prompts, batch.gen_len, pad_token_id=cfg.pad_token_id)
        record_generation(recorder, out, prompts, seq_ids=range(seq, seq + len(prompts)))
        seq += len(prompts)
    trace = recorder.build()
    return trace, {(int(s), int(p)): i for i, (s, p) in enumerate(zip(trace.seq, trace.pos))}


def make_predictors(predictor: Any, distances: list[int], model: Any, trace: Any) -> dict[int, Predictor]:
    """One predictor per forecast distance from a `predictor` config node (a trained checkpoint serves
    only its own distance)."""
    if predictor.get("checkpoint"):
        d = int(predictor.distance)
        return {d: load_predictor(predictor, model=model, trace=trace, distance=d)}
    return {d: load_predictor(predictor, model=model, trace=trace, distance=d) for d in distances}


def serve(executor: OffloadExecutor, batches: list, cfg: ModelConfig, seq_offset: int = 0
          ) -> tuple[list[OffloadOutput], float]:
    outs, start = [], time.perf_counter()
    for batch in batches:
        executor.seq_offset = seq_offset
        outs.append(executor.generate(batch.token_lists(), batch.gen_len, pad_token_id=cfg.pad_token_id))
        seq_offset += batch.batch_size
    return outs, time.perf_counter() - start


def first_of_each_shape(batches: list) -> list[int]:
    """Indices of the first batch of each shape the executor runs `batches` at (`padded_shapes`)."""
    firsts: dict[tuple[int, int, int], int] = {}
    for i, b in enumerate(batches):
        firsts.setdefault(padded_shapes(b.token_lists(), b.gen_len), i)
    return sorted(firsts.values())


def warm_up(executor: OffloadExecutor, batches: list, cfg: ModelConfig, seq_offset: int = 0) -> None:
    """Serve the first batch of each shape in `batches`, so that serving them compiles little (the
    plan-dependent device calls aside): a compile takes ~0.3 s against ~1 s for a whole batch of the
    default job. Each is served with its own sequence ids (reference-trace lookups)."""
    offsets = seq_offset + np.cumsum([0] + [b.batch_size for b in batches[:-1]])
    for i in first_of_each_shape(batches):
        serve(executor, batches[i:i + 1], cfg, seq_offset=int(offsets[i]))


# the layer metrics' times sum the MoE layers of the last batch (what the simulator models); the
# headline throughput, decode latency and prefill time `run` reports are wall clock over every batch
MOE_LAYER_KEYS = {"decode_latency_s": "moe_layers_decode_latency_s", "prefill_s": "moe_layers_prefill_s",
                  "decode_s": "moe_layers_decode_s", "total_s": "moe_layers_total_s"}


def run(node: DictConfig, tm: Telemetry) -> dict[str, Any]:
    rc: RunConfig = OmegaConf.to_object(node)  # type: ignore[assignment]
    dtype = jnp.bfloat16 if rc.dtype.value == "bfloat16" else jnp.float32
    cfg, model, store, tokenizer, full = load_offload_model(node, dtype, rc.seed)
    if tokenizer is None:
        raise ValueError(f"model {node.model.name}: no tokenizer next to the checkpoint; text workloads need one "
                         "(use a shipped trained model, e.g. model=mixtral_tiny)")
    sampler = build_workload(node.workload, tokenizer, separator_id=cfg.eos_token_id)
    if not isinstance(sampler, PromptSampler):
        raise ValueError("engine.run serves prompt workloads (workload=sharegpt, sharegpt_512, code)")
    profile = list(sampler.batches(rc.profile_batches)) if rc.profile_batches else []
    batches = list(sampler.batches(rc.workload.num_batches))
    hw = to_frozen(node.hardware, HardwareProfile)
    cost = CostModel(cfg, hw, str(node.model.name), bytes_per_param=store.dtype.itemsize)
    slots = cache_slots(cfg, rc.offload, store.expert_bytes)
    settings = to_frozen(node.scheduler, SchedulerSettings)
    o = rc.offload
    mech = OffloadSettings(cache_slots=slots, staging_slots=o.staging_slots, chunks=o.chunks, async_io=o.async_io,
                           cpu_threads=o.cpu_threads, cpu_dtype=o.cpu_dtype.value, retries=o.retries,
                           validate_plans=o.validate_plans, fuse_resident=o.fuse_resident)
    L, E = len(cfg.moe_layers), cfg.num_experts

    trace, rows = (None, {})
    if rc.predictor.kind.value == "oracle":  # it replays the in-memory model's routing (~20 s of capture here)
        if full is None:
            raise ValueError("predictor=oracle needs the in-memory model (compare_in_memory=true, a checkpoint with "
                             "experts)")
        trace, rows = reference_trace(full, cfg, profile + batches, str(node.model.name))
    predictors = make_predictors(node.predictor, list(rc.predictor_distances), model, trace) if settings.use_predictor else {}
    lookup = (lambda s, p: np.array([rows[(int(a), int(b))] for a, b in zip(s, p)])) if rows else None

    # the Counter: profiling batches served with on-demand loading rank the experts for the hot table
    profile_loads = np.zeros((L, E), np.int64)
    if profile:
        counter = build_scheduler(SchedulerSettings(kind=settings.kind.__class__("ondemand"), label="profile",
                                                    hot_table=False),
                                  SchedulerSetup(L, E, cfg.num_experts_per_tok, slots, cost))
        with OffloadExecutor(model, store, counter, cost, mech, {}, lookup) as ex:
            serve(ex, profile, cfg)
            profile_loads = ex.expert_tokens.copy()
    scheduler = build_scheduler(settings, SchedulerSetup(L, E, cfg.num_experts_per_tok, slots, cost, profile_loads))
    with OffloadExecutor(model, store, scheduler, cost, mech, predictors, lookup) as ex:
        seq_offset = sum(b.batch_size for b in profile)
        warm_up(ex, batches, cfg, seq_offset)
        outs, wall = serve(ex, batches, cfg, seq_offset=seq_offset)
        timer = ex.timer.summary()
    generated = int(sum(o.lengths.sum() for o in outs))
    decode_steps = [s for o in outs for s in o.step_s]
    metrics = outs[-1].metrics.summary(int(outs[-1].lengths.sum()))
    results: dict[str, Any] = {
        "model": node.model.name, "scheduler": settings.label, "predictor": rc.predictor.name,
        "hardware_profile": hw.name, "batch_size": rc.workload.batch_size, "batches": len(batches),
        "cache_slots": slots, "experts_total": L * E, "expert_mib": store.expert_bytes / 2**20,
        "throughput_tok_s": generated / wall, "decode_latency_ms": 1e3 * float(np.mean(decode_steps)) if decode_steps else None,
        "prefill_s": float(np.mean([o.prefill_s for o in outs])), "generated_tokens": generated,
        **{MOE_LAYER_KEYS.get(k, k): v for k, v in metrics.items() if k not in ("throughput_tok_s", "tokens_generated")},
        "timer": timer, "cost_model_after": cost.summary(),
    }
    if rc.compare_in_memory and full is not None:
        gen = Generator(full)
        ref_outs = [gen.generate(b.token_lists(), b.gen_len, pad_token_id=cfg.pad_token_id) for b in batches[:1]]
        start = time.perf_counter()
        ref_outs = [gen.generate(b.token_lists(), b.gen_len, pad_token_id=cfg.pad_token_id) for b in batches]
        ref_wall = time.perf_counter() - start
        same = all(np.array_equal(a.tokens, b.tokens) for a, b in zip(outs, ref_outs))
        results.update({"tokens_match_in_memory": bool(same), "in_memory_throughput_tok_s": generated / ref_wall,
                        "offload_vs_in_memory": ref_wall / wall})
    results["text"] = [tokenizer.decode(s) for s in outs[0].sequences()[:4]]
    events = outs[-1].events
    if events:
        first_pass = min(e.pass_index for e in events)
        tm.save_figure(plot_timeline(events, first_pass, title=f"{settings.label} on {node.model.name}: a decode pass "
                                     f"(budget {slots} of {L * E} experts)"), "timeline.png")
    return results


@hydra_main("run")
def main(node: DictConfig) -> Optional[dict[str, Any]]:
    with Telemetry(node, task="run") as tm:
        results = run(node, tm)
        tm.write_results(results)
        tm.log({k: v for k, v in results.items() if isinstance(v, (int, float))})
        tm.summary(f"engine.run: {results['scheduler']}", {k: v for k, v in results.items()
                                                           if k not in ("text", "per_layer_decode", "timer",
                                                                        "cost_model_after")})
    return results


if __name__ == "__main__":
    main()
