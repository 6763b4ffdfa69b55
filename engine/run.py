"""`python -m engine.run`: the main job. Offloaded MoE inference (LayerScope) of a model serving a workload.

    python -m engine.run                                          # the embedded default, about a minute
    python -m engine.run scheduler=hybrimoe offload.budget_fraction=0.5 workload.batch_size=16
    python -m engine.run -m scheduler=presched,hybrimoe,fiddler,ondemand     # compare systems
    python -m engine.run model.checkpoint=/path/to/hf_folder model.arch=null hardware=a100_pcie4

Flow: load the model (dense weights to the device, routed experts left in the checkpoint's mapped
files, which the host expert store views), build the hot-expert table from `profile_batches` served
first (the Counter), size the device expert cache from the budget, then serve the workload's
batches with the offload executor; optionally (`compare_in_memory`, on by default where the
in-memory model fits beside it) serve them again with the plain in-memory model to check the tokens
(float32: identical; bf16: logits within bf16's own distance from float32, `fidelity`) and to
measure the machinery's cost. Results report the load time and the peak anonymous memory against
the checkpoint's bytes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import numpy as np
from omegaconf import DictConfig, OmegaConf

from conf import hydra_task
from schedulers.hardware import HardwareProfile, composed_profile
from conf.schemas.run import RunConfig
from engine.calibrate import device_memory_gib
from engine.fidelity import fidelity_report, float32_copy, offloaded_forced_logits
from engine.offload.cache import slots_for_budget
from engine.offload.executor import OffloadExecutor, OffloadOutput, new_cache, padded_shapes
from engine.offload.host_alloc import map_large_blocks
from engine.offload.settings import OffloadSettings
from engine.offload.store import ExpertStore, stores_blocks
from engine.recording import record_generation, trace_meta
from engine.sim.timeline import plot_timeline
from core.telemetry import Telemetry, scalars
from core.trace import TraceRecorder
from engine.workloads import PromptBatch, PromptSampler, build_workload, in_flight
from models.config import ModelConfig
from models.generation import Generator
from models.hf import OpenCheckpoint
from models.loading import (DType, ModelSpec, check_weights, load_model, load_tokenizer, model_dtype,
                            open_model_checkpoint, quantized_experts, resolve_model_config)
from models.memory import GIB, PeakMemory, anon_bytes, check_fits, host_memory, memory_report
from models.transformer import param_bytes, without_experts
from predictors.factory import make_predictors
from schedulers.base import PlanningPrice, SchedulerSettings, SchedulerSetup, build_scheduler, scheduler_settings
from schedulers.offload.ondemand import OnDemandSettings
from schedulers.cost import CostModel

log = logging.getLogger(__name__)

DEFAULT_BUDGET_FRACTION = 0.25  # of all routed experts (LayerScope's and HybriMoE's usual setting)


def cache_slots(cfg: ModelConfig, offload: OffloadSettings, expert_bytes: int, dense_bytes: int = 0) -> int:
    """Expert-cache slots of the configured budget; a clear error when it cannot run or exceeds the device.

    With no budget set, a quarter of the experts, but never more than half the device memory the dense
    weights leave (a 60-layer model's quarter would not fit a small GPU)."""
    if offload.cache_slots is not None:
        raise ValueError(f"offload.cache_slots={offload.cache_slots}: engine.run sizes the cache from the budget; set "
                         "offload.budget_experts instead (offload.cache_slots=null)")
    total = cfg.num_experts * len(cfg.moe_layers)
    budget_bytes = offload.budget_bytes
    budget_experts = offload.budget_experts
    given = [k for k, v in (("budget_fraction", offload.budget_fraction), ("budget_experts", budget_experts),
                            ("budget_bytes", budget_bytes)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"offload: set exactly one of budget_fraction / budget_experts / budget_bytes (got {given}); "
                         f"e.g. offload.{given[0]}=null")
    device_bytes = device_memory_gib() * 2**30
    if not given:
        fits = int(max(device_bytes - dense_bytes, 0) / 2 // expert_bytes)
        budget_experts = max(min(int(round(DEFAULT_BUDGET_FRACTION * total)), fits), offload.staging_slots)
        if budget_experts < DEFAULT_BUDGET_FRACTION * total:
            log.info("offload budget: %d experts (half of the %.1f GiB the device has beside the dense weights; a "
                     "quarter of the experts would not fit)", budget_experts, (device_bytes - dense_bytes) / GIB)
    if offload.budget_fraction is not None:
        if not 0 < offload.budget_fraction <= 1:
            raise ValueError(f"offload.budget_fraction: must lie in (0, 1], got {offload.budget_fraction}")
        budget_experts = max(int(round(offload.budget_fraction * total)), 0)
    wanted = budget_bytes if budget_bytes is not None else budget_experts * expert_bytes
    if wanted > device_bytes:
        raise ValueError(f"offload budget of {wanted / 2**30:.2f} GiB exceeds the device's {device_bytes / 2**30:.2f} GiB")
    try:
        return slots_for_budget(budget_bytes, budget_experts, expert_bytes, offload.staging_slots, total)
    except ValueError as exc:
        raise ValueError(f"{exc}; the smallest runnable budget is offload.budget_experts={offload.staging_slots}") from None


@dataclass
class LoadedModel:
    """What an offloaded run serves: the model without its routed experts (they live in `store`), the
    in-memory model with them when it is compared against (`full`), and how long and in what dtype."""

    cfg: ModelConfig
    model: Any
    store: ExpertStore
    tokenizer: Any
    full: Optional[Any]
    dtype: Any
    checkpoint_bytes: Optional[int]
    load_s: float


def wants_comparison(choice: Optional[bool], opened: Optional[OpenCheckpoint], dtype: Any) -> bool:
    """`compare_in_memory`: as set, or (None) whenever the in-memory model fits comfortably beside the run (a
    quarter of the available memory): it doubles the model's memory, which a real checkpoint may not have."""
    if choice is not None:
        return choice
    if opened is None:
        return True
    available = host_memory()[1]
    # experts in blocks are shared by the in-memory model (views of the same mapping): only its dense weights add
    return available is None or opened.param_bytes(np.dtype(dtype), experts=not stores_blocks(opened)) <= available / 4


def load_offload_model(spec: ModelSpec, dtype_choice: DType, compare_choice: Optional[bool], seed: int) -> LoadedModel:
    """Load for an offloaded run: dense weights to the device, routed experts into the host store (views of the
    checkpoint's mapped files when its dtype is the run's), the in-memory model only when compared against."""
    start = time.perf_counter()
    cfg = resolve_model_config(spec)
    opened = open_model_checkpoint(spec)
    dtype = model_dtype(dtype_choice, opened)
    compare = wants_comparison(compare_choice, opened, dtype)
    if opened is not None and stores_blocks(opened) and not compare:
        # experts already in blocks (a saved quantized folder, a GGUF file): the store views the mapped file's blocks
        model = load_model(spec, dtype=dtype, with_experts=False, opened=opened)[1]
        store = ExpertStore.from_checkpoint(opened, dtype=np.dtype(dtype))
        return LoadedModel(cfg, model, store, load_tokenizer(opened.folder, spec), None, dtype, opened.file_bytes,
                           time.perf_counter() - start)
    if opened is None or quantized_experts(spec, opened):
        # random weights, quantized on load, or experts in blocks compared against their in-memory model (small: the
        # store views the model's blocks, which are the mapped file's)
        _, full, _ = load_model(spec, dtype=dtype, seed=seed, opened=opened)
        store = ExpertStore.from_model(full, dtype=np.dtype(dtype))
        model = without_experts(full) if opened is not None else full
        return LoadedModel(cfg, model, store, load_tokenizer(opened.folder, spec) if opened else None,
                           full if compare else None, dtype, opened.file_bytes if opened else None,
                           time.perf_counter() - start)
    check_offload_fits(opened, dtype)
    if compare:
        full = load_model(spec, dtype=dtype, opened=opened)[1]
        model = without_experts(full)
    else:
        full, model = None, load_model(spec, dtype=dtype, with_experts=False, opened=opened)[1]
    check_weights(spec, opened)  # the experts the store maps (a no-op where the in-memory copy was scanned)
    store = ExpertStore.from_checkpoint(opened, dtype=np.dtype(dtype))
    return LoadedModel(cfg, model, store, load_tokenizer(opened.folder, spec), full, dtype, opened.file_bytes,
                       time.perf_counter() - start)


def check_offload_fits(opened: OpenCheckpoint, dtype: Any) -> None:
    """An offloaded run keeps the routed experts in the checkpoint's files (page cache) or, stored in another
    dtype, in converted host copies; either way they must fit in host memory, or every step reads the disk."""
    total, available = host_memory()
    experts = opened.param_bytes(np.dtype(dtype)) - opened.param_bytes(np.dtype(dtype), experts=False)
    if total is not None and experts > total:
        raise MemoryError(f"model.checkpoint {opened.folder}: its routed experts take {experts / GIB:.1f} GiB in "
                          f"{np.dtype(dtype).name}, more than this machine's {total / GIB:.1f} GiB of memory; every "
                          "decode step would read them from disk")
    converted = experts if np.dtype(dtype) != opened.stored_dtype() else 0
    check_fits(opened.param_bytes(np.dtype(dtype), experts=False) + converted,
               f"model.checkpoint {opened.folder} offloaded in {np.dtype(dtype).name}",
               f"run it in its own dtype (dtype=auto: {opened.stored_dtype().name}), whose experts stay in the "
               "mapped files", available)


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


def served_batches(sampler: PromptSampler, count: int, settings: SchedulerSettings) -> list[PromptBatch]:
    """The workload's `count` batches as the executor serves them: joined `settings.in_flight` at a time (Klotski's
    two batches go through the layers together, as the simulator replays them)."""
    return in_flight(list(sampler.batches(count)), settings.in_flight)


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
    plan-dependent device calls aside): a compile takes a sizeable share of a whole batch of the default
    job. Each is served with its own sequence ids (reference-trace lookups)."""
    offsets = seq_offset + np.cumsum([0] + [b.batch_size for b in batches[:-1]])
    for i in first_of_each_shape(batches):
        serve(executor, batches[i:i + 1], cfg, seq_offset=int(offsets[i]))


# the layer metrics' times sum the MoE layers of the last batch (what the simulator models); the
# headline throughput, decode latency and prefill time `run` reports are wall clock over every batch
MOE_LAYER_KEYS = {"decode_latency_s": "moe_layers_decode_latency_s", "prefill_s": "moe_layers_prefill_s",
                  "decode_s": "moe_layers_decode_s", "total_s": "moe_layers_total_s"}


def default_distances(num_moe_layers: int) -> list[int]:
    """Forecast distances PreSched may use (Q4 of LayerScope: up to 3 layers ahead) that the model's depth has."""
    return [d for d in (1, 2, 3) if d < num_moe_layers]


def forecast_distances(rc: RunConfig, num_moe_layers: int) -> list[int]:
    """`predictor_distances` as set (each must reach a later MoE layer), or derived from the depth."""
    if rc.predictor_distances is None:
        return default_distances(num_moe_layers)
    bad = [d for d in rc.predictor_distances if not 0 < d < num_moe_layers]
    if bad:
        raise ValueError(f"predictor_distances: {bad} reach no later layer of a model with {num_moe_layers} MoE layers; "
                         f"use distances in [1, {num_moe_layers - 1}] (predictor_distances=null derives them)")
    return list(rc.predictor_distances)


def run(node: DictConfig, tm: Telemetry) -> dict[str, Any]:
    rc: RunConfig = OmegaConf.to_object(node)  # type: ignore[assignment]
    hardware = composed_profile(node.hardware)  # its defaults are the keys the composition left unset: read off the node
    map_large_blocks(rc.offload.host_mmap_threshold_kib)  # before loading: the slots and the run's buffers
    with PeakMemory() as peak:  # loading and serving (with the in-memory model too when it is compared)
        loaded = load_offload_model(rc.model, rc.dtype, rc.compare_in_memory, rc.seed)
        phases = {"after_load": anon_bytes()}
        results, executor, outs, batches, wall = serve_offloaded(rc, hardware, loaded, tm, phases)
    results.update({"dtype": np.dtype(loaded.dtype).name, "load_s": loaded.load_s,
                    "compared_in_memory": loaded.full is not None, **memory_report(peak, loaded.checkpoint_bytes),
                    **anon_phases(phases)})
    if loaded.full is not None:
        results.update(compare_with_in_memory(loaded, batches, outs, executor, wall))
    results["text"] = [loaded.tokenizer.decode(s) for s in outs[0].sequences()[:4]] if loaded.tokenizer else []
    return results


def anon_phases(phases: dict[str, Optional[int]]) -> dict[str, Any]:
    """Results entries of the anonymous memory at each phase's end (`anon_<phase>_bytes`) and what the measured
    batches added after the warm-up (`anon_growth_serving_bytes`: ~0 when a run's memory is flat)."""
    out: dict[str, Any] = {f"anon_{k}_bytes": v for k, v in phases.items()}
    if phases.get("after_serving") is not None and phases.get("after_warm_up") is not None:
        out["anon_growth_serving_bytes"] = phases["after_serving"] - phases["after_warm_up"]
    return out


def serve_offloaded(rc: RunConfig, hardware: tuple[HardwareProfile, dict[str, object]], loaded: LoadedModel,
                    tm: Telemetry, phases: Optional[dict[str, Optional[int]]] = None
                    ) -> tuple[dict[str, Any], Callable[[], OffloadExecutor], list[OffloadOutput], list, float]:
    """Profile, warm up and serve the workload offloaded: (results, a factory of executors like the measured
    one, the measured outputs, their batches, the seconds serving them took). `hardware`: `composed_profile`'s;
    `phases` gets the anonymous memory after the profiling, the warm-up and the measured batches."""
    phases = {} if phases is None else phases
    cfg, model, store, full = loaded.cfg, loaded.model, loaded.store, loaded.full
    if loaded.tokenizer is None:
        raise ValueError(f"model {rc.model.name}: no tokenizer next to the checkpoint; text workloads need one "
                         "(use a shipped trained model, e.g. model=mixtral_tiny)")
    sampler = build_workload(rc.workload, loaded.tokenizer, separator_id=cfg.eos_token_id)
    if not isinstance(sampler, PromptSampler):
        raise ValueError("engine.run serves prompt workloads (workload=sharegpt, sharegpt_512, code)")
    profile = list(sampler.batches(rc.profile_batches)) if rc.profile_batches else []
    settings = scheduler_settings(rc.scheduler)
    batches = served_batches(sampler, rc.workload.num_batches, settings)
    hw, hw_defaults = hardware
    cost = CostModel(cfg, hw, str(rc.model.name), bytes_per_param=store.dtype.itemsize, expert_bytes=store.expert_bytes,
                     **store.cost_format())  # the experts' bytes and their block types' CPU rates
    slots = cache_slots(cfg, rc.offload, store.expert_bytes, dense_bytes=param_bytes(model))
    mech = replace(rc.offload, cache_slots=slots)
    L, E = len(cfg.moe_layers), cfg.num_experts

    trace, rows = (None, {})
    if rc.predictor.kind.value == "oracle":  # it replays the in-memory model's routing (a capture run)
        if full is None:
            raise ValueError("predictor=oracle needs the in-memory model (compare_in_memory=true, a checkpoint with "
                             "experts)")
        trace, rows = reference_trace(full, cfg, profile + batches, str(rc.model.name))
    distances = forecast_distances(rc, L)
    predictors = make_predictors(rc.predictor, distances, model=model, trace=trace) if settings.use_predictor and distances else {}
    lookup = (lambda s, p: np.array([rows[(int(a), int(b))] for a, b in zip(s, p)])) if rows else None

    cache = new_cache(cfg, mech, loaded.dtype, store)  # one set of device slots for every executor of the run
    # the Counter: profiling batches served with on-demand loading rank the experts for the hot table
    profile_loads = np.zeros((L, E), np.int64)
    if profile:
        counter = build_scheduler(OnDemandSettings(label="profile", hot_table=False),
                                  SchedulerSetup(L, E, cfg.num_experts_per_tok, slots, cost))
        with OffloadExecutor(model, store, counter, cost, mech, {}, lookup, cache=cache) as ex:
            serve(ex, profile, cfg)
            profile_loads = ex.expert_tokens.copy()
        phases["after_profile"] = anon_bytes()
    # the executor waits for every plan on the host (its `planning_ms`): its price is the plan's wall time
    setup = SchedulerSetup(L, E, cfg.num_experts_per_tok, slots, cost, profile_loads, PlanningPrice(time.perf_counter))

    def executor() -> OffloadExecutor:
        return OffloadExecutor(model, store, build_scheduler(settings, setup), cost, mech, predictors, lookup,
                               cache=cache)

    with executor() as ex:
        seq_offset = sum(b.batch_size for b in profile)
        warm_up(ex, batches, cfg, seq_offset)
        phases["after_warm_up"] = anon_bytes()
        ex.stages.clear()  # the measured batches' layers only
        outs, wall = serve(ex, batches, cfg, seq_offset=seq_offset)
        phases["after_serving"] = anon_bytes()
        timer = ex.timer.summary()
        planning, breakdown = ex.stages.planning(), ex.stages.decode_breakdown()
    generated = int(sum(o.lengths.sum() for o in outs))
    decode_steps = [s for o in outs for s in o.step_s]
    metrics = outs[-1].metrics.summary(int(outs[-1].lengths.sum()))
    step_ms = 1e3 * float(np.mean(decode_steps)) if decode_steps else None
    results: dict[str, Any] = {
        "model": rc.model.name, "scheduler": settings.label, "predictor": rc.predictor.name,
        "predictor_distances": sorted(predictors), "hardware_profile": hw.name, "hardware_defaults": hw_defaults,
        "batch_size": rc.workload.batch_size, "batches_in_flight": settings.in_flight, "batches": len(batches),
        "cache_slots": slots, "experts_total": L * E, "expert_mib": store.expert_bytes / 2**20,
        # the cache's budget and what its slots hold at the end (quantized slots at their experts' own row bytes)
        "expert_cache_bytes": cache.device_bytes, "expert_cache_held_bytes": cache.held_bytes(),
        "throughput_tok_s": generated / wall, "decode_latency_ms": step_ms,
        "decode_tokens_per_s": sum(len(o.lengths) * len(o.step_s) for o in outs) / sum(decode_steps) if step_ms else None,
        "prefill_s": float(np.mean([o.prefill_s for o in outs])), "generated_tokens": generated,
        **{MOE_LAYER_KEYS.get(k, k): v for k, v in metrics.items() if k not in ("throughput_tok_s", "tokens_generated")},
        "timer": timer, "cost_model_after": cost.summary(),
        # the policy's plan call per MoE layer (median / p99 per phase; flat decode keys for wandb) and where a decode
        # MoE layer's wall time goes (engine.offload.stages)
        "planning_ms": planning, "decode_layer_breakdown": breakdown,
        **{f"plan_{k}_{phase}": v for phase, row in planning.items() for k, v in row.items() if k.endswith("_ms")},
        **({"executor_own_ms_per_layer": breakdown["executor_own_ms"], "layer_ms_decode": breakdown["layer_ms"]}
           if breakdown else {}),
    }
    results["timeline"] = draw_timelines(tm, outs[-1], f"{settings.label} on {rc.model.name}, budget {slots} of "
                                         f"{L * E} experts, batch {rc.workload.batch_size}")
    return results, executor, outs, batches, wall


def representative_step(out: OffloadOutput) -> Optional[int]:
    """The decode step to draw: of the recorded steps after the first (it may still compile or fill the cache),
    the one whose wall time is the median; None when no such step has per-layer events (a fused device loop)."""
    layered = {e.pass_index for e in out.events if e.kind != "fused decode"}
    steps = [k for k in range(2, len(out.step_s) + 1) if out.prefill_pass + k in layered]
    if not steps and out.step_s and out.prefill_pass + 1 in layered:
        steps = [1]
    if not steps:
        return None
    order = sorted(steps, key=lambda k: out.step_s[k - 1])
    return order[(len(order) - 1) // 2]


def pass_span_ms(out: OffloadOutput, pass_index: int) -> float:
    """First start to last end of a pass's recorded events, in ms."""
    evs = [e for e in out.events if e.pass_index == pass_index]
    return 1e3 * (max(e.end for e in evs) - min(e.start for e in evs))


def draw_timelines(tm: Telemetry, out: OffloadOutput, what: str) -> dict[str, Any]:
    """timeline.png: a representative decode pass (`representative_step`) of the last batch; timeline_prefill.png:
    its prefill. Each title says which pass it is and how long it took next to the run's figures."""
    drawn: dict[str, Any] = {}
    step = representative_step(out)
    if step is not None:
        p = out.prefill_pass + step
        wall = 1e3 * out.step_s[step - 1]
        median = 1e3 * float(np.median(out.step_s))
        drawn["decode"] = {"step": step, "wall_ms": wall, "span_ms": pass_span_ms(out, p),
                           "median_step_ms": median}
        tm.save_figure(plot_timeline(out.events, p, title=f"{what}: decode step {step} of {len(out.step_s)} "
                                     f"({wall:.1f} ms; median step {median:.1f} ms), last batch"), "timeline.png")
    else:
        drawn["decode"] = "not drawn: the decode ran as one fused device loop (every routed expert resident)"
    if any(e.pass_index == out.prefill_pass for e in out.events):
        drawn["prefill"] = {"wall_ms": 1e3 * out.prefill_s, "span_ms": pass_span_ms(out, out.prefill_pass)}
        tm.save_figure(plot_timeline(out.events, out.prefill_pass, title=f"{what}: the prefill pass "
                                     f"({1e3 * out.prefill_s:.1f} ms), last batch"), "timeline_prefill.png")
    return drawn


def compare_with_in_memory(loaded: LoadedModel, batches: list, outs: list[OffloadOutput],
                           executor: Callable[[], OffloadExecutor], wall: float) -> dict[str, Any]:
    """Tokens and speed against the plain in-memory model on the same batches (`wall`: the seconds the
    offloaded run took to serve them, everything between the batches included, as the in-memory time is);
    in bf16 also the logits' distance from it next to bf16's own distance from float32 (`fidelity`)."""
    cfg, full = loaded.cfg, loaded.full
    gen = Generator(full)
    gen.generate(batches[0].token_lists(), batches[0].gen_len, pad_token_id=cfg.pad_token_id)  # compiles
    start = time.perf_counter()
    ref_outs = [gen.generate(b.token_lists(), b.gen_len, pad_token_id=cfg.pad_token_id) for b in batches]
    ref_wall = time.perf_counter() - start
    same = all(np.array_equal(a.tokens, b.tokens) for a, b in zip(outs, ref_outs))
    generated = int(sum(o.lengths.sum() for o in outs))
    results: dict[str, Any] = {"tokens_match_in_memory": bool(same), "in_memory_throughput_tok_s": generated / ref_wall,
                               "offload_vs_in_memory": ref_wall / wall}
    prompts, forced, pad = batches[0].token_lists(), outs[0].tokens, cfg.pad_token_id
    with executor() as ex:
        offloaded = offloaded_forced_logits(ex, prompts, forced, pad)
    fp32 = None
    if np.dtype(loaded.dtype) != np.float32:
        fp32 = Generator(float32_copy(full)).forced_logits(prompts, forced, pad)
    results["fidelity"] = fidelity_report(offloaded, gen.forced_logits(prompts, forced, pad), fp32)
    if results["fidelity"]["within_envelope"] is False:
        log.warning("offloaded logits differ from the in-memory model's by more than %s differs from float32: %s",
                    np.dtype(loaded.dtype).name, results["fidelity"])
    return results


main = hydra_task("run", title=lambda r: f"engine.run: {r['scheduler']}", metrics=scalars,
                  hide=("text", "per_layer_decode", "timer", "cost_model_after", "planning_ms",
                        "decode_layer_breakdown"))(run)


if __name__ == "__main__":
    main()
