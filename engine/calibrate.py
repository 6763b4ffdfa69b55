"""`python -m engine.calibrate`: measure this machine and write a hardware profile (conf/hardware schema).

    python -m engine.calibrate                                  # the default tiny model, profile in the run dir
    python -m engine.calibrate model=bench_mixtral_29m out=conf/hardware/local_cpu.yaml

Measured with the real mechanism on the real device: expert transfers through the AsyncIO link
(and synchronous copies, for the ablation's slowdown), one expert on the device for several token
counts (t_g), one expert on the CPU with torch (eq. 2: t_c(m) = beta * m + C, fitted), a dense
GEMM and a memory-bound reduction on the device (roofline of attention), and the fixed cost of one
device call. The expert kernel is timed with one expert and with every expert in one call, which
separates the per-call dispatch (`call_overhead_us`) from the per-expert cost (`kernel_overhead_us`).
Finally the offload executor itself decodes a batch with every expert resident, and its Timer's
medians give the fixed host time per MoE layer (`layer_overhead_us`: router output to the host,
planning, issuing; attention as modelled is subtracted) and per pass (`pass_overhead_us`).
Efficiencies are 1: every number is an achieved rate. The profile carries the model's times under
`measured`, which the cost model prefers to its roofline; other models' `measured` entries already
in the output file are kept.
"""

from __future__ import annotations

import datetime
import platform
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from omegaconf import DictConfig, OmegaConf

from core.config import resolve_path
from conf import hydra_task
from conf.schemas.calibrate import CalibrateConfig
from schedulers.hardware import CpuSpec, ExpertTimes, GpuSpec, HardwareProfile, HostLink, Interconnect
from engine.offload.cache import DeviceExpertCache
from engine.offload.cpu_experts import CpuExperts
from engine.offload.kernels import LayerKernels
from engine.offload.link import Job, TransferLink
from engine.offload.store import ExpertStore
from core.telemetry import Telemetry, atomic_write_text
from models.config import ModelConfig
from models.loading import load_model
from models.transformer import MoETransformer


def best_of(fn: Callable[[], Any], repeats: int) -> float:
    """Best wall time of `fn()` (which must block until its work is done) over `repeats` runs, after a warm-up."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure_transfers(store: ExpertStore, synchronous: bool, repeats: int, chunks: int = 2) -> float:
    """Median seconds of one expert transfer (store -> a fresh cache slot) through the link."""
    cache = DeviceExpertCache(store.cfg, cache_slots=1, staging_slots=1, dtype=store.dtype,
                              block_widths=store.slot_widths() if store.quantized else None)
    link = TransferLink(store, cache, chunks=chunks, synchronous=synchronous)
    times = []
    try:
        for r in range(repeats + 1):
            e = r % store.num_experts
            job = Job(0, e, cache.reserve(0, e, staging=False), retain=True, prefetch=False)
            link.submit([job])
            times.append(link.wait(0, e).seconds)
            cache.evict(0, e)
    finally:
        link.close()
    return float(np.median(times[1:]))


def measure_cpu_expert(store: ExpertStore, token_counts: list[int], repeats: int, threads: int = 1
                       ) -> tuple[float, float]:
    """(beta, C) of eq. 2 fitted to torch CPU expert times over `token_counts`."""
    times = [CpuExperts.time_expert(store, 0, 0, m, repeats=repeats, threads=threads) for m in token_counts]
    beta, c = np.polyfit(np.asarray(token_counts, float), np.asarray(times), 1)
    return float(max(beta, 1e-9)), float(max(c, 0.0))


def slot_arrays(store: ExpertStore, layer: int, expert: int) -> tuple[jax.Array, jax.Array]:
    """(gate|up, down) of one expert as a device cache slot holds it: rows [2F, H] and [H, F] in the store's dtype,
    or for quantized experts their block bytes in uint8 slots as wide as the widest layer's rows."""
    gate, up, down = store.numpy_views(layer, expert)
    gate_up = np.concatenate([gate, up], axis=0)
    if store.quantized:
        gu_w, dn_w = store.slot_widths()
        gate_up = np.pad(gate_up, ((0, 0), (0, gu_w - gate_up.shape[1])))
        down = np.pad(down, ((0, 0), (0, dn_w - down.shape[1])))
    return jnp.asarray(gate_up), jnp.asarray(down)


def expert_kernels(model: MoETransformer, store: ExpertStore) -> LayerKernels:
    """The offload executor's device calls for `model`, reading quantized slots in the store's block types."""
    formats = tuple(store.formats[m] for m in range(store.num_layers)) if store.quantized else None
    return LayerKernels(model, formats=formats)


def measure_device_expert(model: MoETransformer, store: ExpertStore, token_counts: list[int], repeats: int
                          ) -> dict[int, float]:
    """Seconds of one resident expert on the device for each token count (the executor's own kernel; quantized
    experts dequantized inside it, as the executor runs them)."""
    cfg = model.cfg
    kernels = expert_kernels(model, store)
    gate_up, down = slot_arrays(store, 0, 0)
    dummy = (jnp.zeros_like(gate_up), jnp.zeros_like(down))
    out = {}
    for m in token_counts:
        g = jnp.asarray(np.random.default_rng(m).standard_normal((1, m, cfg.hidden_size)), model.embed[...].dtype)
        idx = np.full((m, cfg.num_experts_per_tok), -1, np.int32)
        idx[:, 0] = 0
        w = np.ones((m, cfg.num_experts_per_tok), np.float32)
        gu = [gate_up] + [dummy[0]] * (cfg.num_experts - 1)
        dn = [down] + [dummy[1]] * (cfg.num_experts - 1)
        out[m] = best_of(lambda: kernels.experts(g, idx, w, gu, dn, layer=0).block_until_ready(), repeats)
    return out


def measure_expert_call(model: MoETransformer, store: ExpertStore, repeats: int) -> tuple[float, float]:
    """(seconds of one call with one expert, seconds of one call with every expert), one token each."""
    cfg = model.cfg
    kernels = expert_kernels(model, store)
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    gate_up, down = slot_arrays(store, 0, 0)
    gu, dn = [gate_up + 0 for _ in range(E)], [down + 0 for _ in range(E)]
    g = jnp.asarray(np.random.default_rng(0).standard_normal((1, E, cfg.hidden_size)), model.embed[...].dtype)
    w = np.ones((E, k), np.float32)
    one = np.full((E, k), -1, np.int32)
    one[0, 0] = 0
    every = np.full((E, k), -1, np.int32)
    every[:, 0] = np.arange(E)
    t_one = best_of(lambda: kernels.experts(g, one, w, gu, dn, layer=0).block_until_ready(), repeats * 4)
    t_all = best_of(lambda: kernels.experts(g, every, w, gu, dn, layer=0).block_until_ready(), repeats * 4)
    return t_one, t_all


def measure_executor_overheads(model: MoETransformer, store: ExpertStore, cost: Any, batch: int, prompt_len: int,
                               new_tokens: int, seed: int = 0) -> tuple[float, float]:
    """(fixed host seconds per MoE layer, per forward pass): the Timer's medians over a decode with every
    expert resident (the same definition the Timer refines online)."""
    from engine.offload.executor import OffloadExecutor, OffloadSettings
    from schedulers.base import SchedulerSetup, build_scheduler
    from schedulers.offload.ktransformers import KTransformersSettings

    cfg = model.cfg
    L, E = len(cfg.moe_layers), cfg.num_experts
    sched = build_scheduler(KTransformersSettings(label="calibrate", use_predictor=False),
                            SchedulerSetup(L, E, cfg.num_experts_per_tok, L * E, cost, np.ones((L, E), np.int64)))
    prompts = np.random.default_rng(seed).integers(3, cfg.vocab_size, (batch, prompt_len)).tolist()
    with OffloadExecutor(model, store, sched, cost, OffloadSettings(cache_slots=L * E, validate_plans=False,
                                                                       fuse_resident=False)) as ex:
        ex.generate(prompts, new_tokens)  # compiles
        ex.timer.samples.clear()
        ex.generate(prompts, new_tokens)
        layer = float(np.median(ex.timer.samples["layer_overhead_s"]))
        pass_ = float(np.median(ex.timer.samples["pass_overhead_s"]))
    return max(layer, 0.0), max(pass_, 0.0)


def measure_cpu_dispatch(store: ExpertStore, repeats: int, threads: int = 1) -> float:
    """Seconds a layer's CPU side costs beyond its experts' compute: hand-over to the worker thread and
    the result back as a device array (one expert, one token; the executor's own path)."""
    cpu = CpuExperts(store, threads=threads)
    x = np.random.default_rng(0).standard_normal((1, store.cfg.hidden_size)).astype(np.float32)
    experts, weights = np.zeros((1, 1), np.int64), np.ones((1, 1), np.float32)
    best = float("inf")
    try:
        for r in range(repeats * 4 + 1):
            cpu.timings.clear()
            t = time.perf_counter()
            jnp.asarray(cpu.submit(0, x, experts, weights, [0]).result()).block_until_ready()
            if r:
                best = min(best, time.perf_counter() - t - sum(s for _, s in cpu.timings))
    finally:
        cpu.close()
    return max(best, 0.0)


def measure_device_roofline(repeats: int) -> tuple[float, float, float]:
    """(TFLOP/s of a 1024^2 GEMM, GB/s of a 64 MiB reduction, seconds of an empty call) on the device."""
    a = jnp.ones((1024, 1024), jnp.float32)
    mm = jax.jit(lambda x: x @ x)
    gemm = best_of(lambda: mm(a).block_until_ready(), repeats)
    big = jnp.ones((16 * 2**20,), jnp.float32)
    red = jax.jit(jnp.sum)
    stream = best_of(lambda: red(big).block_until_ready(), repeats)
    tiny = jnp.ones((4,), jnp.float32)
    nop = jax.jit(lambda x: x + 1)
    call = best_of(lambda: nop(tiny).block_until_ready(), repeats * 10)
    return 2 * 1024 ** 3 / gemm / 1e12, big.nbytes / stream / 1e9, call


def device_memory_gib() -> float:
    """Device memory (the allocator's limit where the backend reports one, else physical host RAM)."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return stats["bytes_limit"] / 2**30
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def calibrate(cfg: ModelConfig, model: MoETransformer, store: ExpertStore, name: str, model_name: str,
              repeats: int = 5, token_counts: Optional[list[int]] = None, batch: int = 8, prompt_len: int = 32,
              new_tokens: int = 16) -> tuple[HardwareProfile, dict[str, float]]:
    """Measure everything and return (profile, raw figures)."""
    import dataclasses

    from schedulers.cost import CostModel

    token_counts = token_counts or [1, 4, 16, 64]
    fmt = store.cost_format()  # quantized experts: every time below is taken on their blocks (the block kernels)
    t_io = measure_transfers(store, synchronous=False, repeats=repeats)
    t_io_sync = measure_transfers(store, synchronous=True, repeats=repeats)
    part_store_bytes = store.expert_bytes
    beta, c = measure_cpu_expert(store, token_counts, repeats)
    cpu_dispatch = measure_cpu_dispatch(store, repeats)
    t_g = measure_device_expert(model, store, token_counts, repeats)
    tflops, gbps, call_s = measure_device_roofline(repeats)
    flops_per_token = 2 * cfg.expert_params
    roofline_1 = max(flops_per_token / (tflops * 1e12), store.expert_bytes / (gbps * 1e9))
    t_one, t_all = measure_expert_call(model, store, repeats)
    per_expert = max((t_all - t_one) / max(cfg.num_experts - 1, 1) - roofline_1, 0.0)
    expert_call = max(t_one - roofline_1 - per_expert, 0.0)
    device = jax.devices()[0]
    on_host = 1.0 if device.platform == "cpu" else 0.0  # CPU backend: copies and device compute use the host cores
    profile = HardwareProfile(
        name=name, num_devices=1,
        gpu=GpuSpec(name=f"{device.platform}:{getattr(device, 'device_kind', '')}", memory_gib=device_memory_gib(),
                    bf16_tflops=tflops, hbm_gbps=gbps, matmul_efficiency=1.0, hbm_efficiency=1.0,
                    kernel_overhead_us=per_expert * 1e6, reserved_gib=0.0, call_overhead_us=expert_call * 1e6,
                    host_cpu_share=on_host),
        cpu=CpuSpec(name=platform.processor() or platform.machine(), cores=_cores(),
                    peak_gflops=flops_per_token / beta / 1e9, memory_gbps=gbps, matmul_efficiency=1.0,
                    memory_efficiency=1.0, expert_overhead_us=c * 1e6, dispatch_us=cpu_dispatch * 1e6),
        host_link=HostLink(name="jax: pinned host -> device slot (AsyncIO link)", peak_gbps=part_store_bytes / t_io / 1e9,
                           efficiency=1.0, latency_us=0.0, sync_copy_slowdown=max(t_io_sync / t_io, 1.0),
                           host_cpu_share=on_host),
        interconnect=Interconnect(),
        measured={model_name: ExpertTimes(transfer_ms=t_io * 1e3, gpu_ms=t_g[min(t_g)] * 1e3, cpu_beta_ms=beta * 1e3,
                                          cpu_startup_ms=c * 1e3, expert_format=fmt["expert_format"],
                                          expert_mib=store.expert_bytes / 2**20)},
    )
    # the executor's fixed host times, measured against the cost model of everything above
    cost = CostModel(cfg, profile, model_name, bytes_per_param=store.dtype.itemsize, expert_bytes=store.expert_bytes,
                     **fmt)
    layer_s, pass_s = measure_executor_overheads(model, store, cost, batch, prompt_len, new_tokens)
    gpu = dataclasses.replace(profile.gpu, layer_overhead_us=layer_s * 1e6, pass_overhead_us=pass_s * 1e6)
    times = dataclasses.replace(profile.measured[model_name], call_overhead_ms=expert_call * 1e3,
                                layer_overhead_ms=layer_s * 1e3, pass_overhead_ms=pass_s * 1e3,
                                cpu_dispatch_ms=cpu_dispatch * 1e3)
    profile = dataclasses.replace(profile, gpu=gpu, measured={model_name: times})
    raw = {"t_io_ms": t_io * 1e3, "expert_call_1_ms": t_one * 1e3, f"expert_call_{cfg.num_experts}_ms": t_all * 1e3,
           "call_overhead_ms": expert_call * 1e3, "cpu_dispatch_ms": cpu_dispatch * 1e3, "kernel_overhead_ms": per_expert * 1e3,
           "layer_overhead_ms": layer_s * 1e3, "pass_overhead_ms": pass_s * 1e3, "device_nop_call_us": call_s * 1e6, "t_io_sync_ms": t_io_sync * 1e3, "cpu_beta_ms": beta * 1e3, "cpu_startup_ms": c * 1e3,
           **{f"t_g_{m}_ms": s * 1e3 for m, s in t_g.items()}, "device_gemm_tflops": tflops,
           "device_stream_gbps": gbps, "device_call_us": call_s * 1e6, "expert_mib": store.expert_bytes / 2**20,
           "expert_format": fmt["expert_format"]}
    return profile, raw


def keep_other_models(profile: HardwareProfile, path: Any) -> HardwareProfile:
    """`profile` with the `measured` entries of other models already in the YAML at `path` (if any)."""
    import dataclasses
    from pathlib import Path

    if not Path(path).is_file():
        return profile
    old = (yaml.safe_load(Path(path).read_text()) or {}).get("measured") or {}
    merged = {str(k): ExpertTimes(**{f: v.get(f) for f in ExpertTimes.__dataclass_fields__}) for k, v in old.items()
              if k not in profile.measured}
    return dataclasses.replace(profile, measured={**merged, **profile.measured})


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def profile_yaml(profile: HardwareProfile, source: str) -> str:
    """The profile as a conf/hardware YAML file with its provenance."""
    import dataclasses

    body = dataclasses.asdict(profile)
    header = (f"# Measured by `python -m engine.calibrate` ({source}) on {datetime.date.today().isoformat()},\n"
              f"# {platform.node()} ({platform.machine()}, {_cores()} cores, jax {jax.__version__}, "
              f"backend {jax.default_backend()}). Every rate is achieved, so efficiencies are 1.\n")
    return header + "defaults:\n  - base_hardware\n" + yaml.safe_dump(body, sort_keys=False)


@hydra_task("calibrate")
def main(node: DictConfig, tm: Telemetry) -> dict[str, Any]:
    cfg: CalibrateConfig = OmegaConf.to_object(node)  # type: ignore[assignment]
    model_cfg, model, _ = load_model(node.model, seed=cfg.seed)
    store = ExpertStore.from_model(model)
    profile, raw = calibrate(model_cfg, model, store, cfg.name, str(node.model.name), cfg.repeats,
                             list(cfg.token_counts), cfg.batch, cfg.prompt_len, cfg.new_tokens)
    out = resolve_path(cfg.out) if cfg.out else tm.run_dir / f"{cfg.name}.yaml"
    profile = keep_other_models(profile, out)
    text = profile_yaml(profile, f"model={node.model.name}")
    atomic_write_text(out, text)
    raw["profile"] = str(out)
    return raw


if __name__ == "__main__":
    main()
