"""`python -m engine.bench.gpu_check`: the offload executor on one accelerator, checked in one prepared run.

    python -m engine.bench.gpu_check                       # on a GPU: Mixtral width, 2 layers, about 5 minutes
    python -m engine.bench.gpu_check --fast                # tiny width on any backend (the CI test runs this)
    python -m engine.bench.gpu_check --family qwen3_moe --layers 4 --out runs/gpu_check

1. Device: platform, kind, its memory kinds; whether host experts live in page-locked memory (`pinned_host`,
   the AsyncIO source LayerScope uses) or, on the CPU backend, stay views of the checkpoint's mapped files.
2. A random-weight checkpoint at the real width of `--family`, cut to `--layers` decoder layers, built on the fly
   under `--out` (deleted at the end unless `--keep`); `--fast` makes a tiny-width one.
3. Host-to-device bandwidth through the AsyncIO link (engine.calibrate's transfer measure, median of repeats)
   against the link peak of the hardware profile named for the device and LayerScope's Table 2 (66-80 % of peak).
4. `engine.calibrate` on this machine and model: a measured hardware profile (written to the output folder).
5. `engine.run`'s serving path, offloaded with that profile's cost model, for the default policy of conf/run.yaml
   and PreSched and HybriMoE (read from conf: the default follows the config): wall-clock throughput, decode step,
   planning time per layer, `tokens_match_in_memory` against the in-memory model.
6. The simulator with the calibrated profile on the same model, policy and sizes: its predicted decode step over
   the measured one (1.0 = exact).

One summary table is printed and everything goes to `<out>/results.json`. Every stage runs against one deadline
(`--deadline-s`, default 540 s): a stage that would start after it is reported as skipped, never left hanging.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import numpy as np

REPO = Path(__file__).resolve().parents[2]
TABLE2_BAND = (0.66, 0.80)  # LayerScope Table 2: achieved host-to-device bandwidth as a share of the link's peak
POLICIES = ("presched", "hybrimoe")  # compared with the default policy, whatever conf/run.yaml names
PROFILE_BY_DEVICE = (("h100", "h200_pcie5"), ("h200", "h200_pcie5"), ("a100", "a100_pcie4"), ("v100", "v100_pcie3"),
                     ("4090", "rtx4090"), ("a6000", "a6000"))  # device kind -> conf/hardware profile of its host link
FAST_WIDTH = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 32000}


class StageTimeout(Exception):
    """A stage ran past the check's deadline."""


def device_report() -> dict[str, Any]:
    """The device the check runs on, its memory kinds, and where host experts will live."""
    from engine.offload.store import wants_pinned

    device = jax.devices()[0]
    kinds = sorted(m.kind for m in device.addressable_memories())
    return {"platform": device.platform, "device_kind": getattr(device, "device_kind", ""), "devices": jax.device_count(),
            "memory_kinds": kinds, "pinned_host": wants_pinned(device), "jax": jax.__version__}


def default_policy() -> str:
    """The scheduler conf/run.yaml's defaults list names (the policy `make run` serves with)."""
    import yaml

    for entry in yaml.safe_load((REPO / "conf" / "run.yaml").read_text())["defaults"]:
        if isinstance(entry, dict) and "scheduler" in entry:
            return str(entry["scheduler"])
    raise ValueError("conf/run.yaml: no scheduler in its defaults list")


def link_profile(device: dict[str, Any]) -> str:
    """The conf/hardware profile whose host link is this device's (local_cpu on the CPU backend)."""
    kind = device["device_kind"].lower()
    if device["platform"] == "cpu":
        return "local_cpu"
    return next((name for key, name in PROFILE_BY_DEVICE if key in kind), "h200_pcie5")


def build_checkpoint(family: str, layers: int, fast: bool, root: Path) -> tuple[Path, Any]:
    """A random-weight checkpoint of `family` at real (or, `fast`, tiny) width and `layers` layers under `root`."""
    from engine.bench.real_width import cached_checkpoint, describe, real_width_config

    cfg = real_width_config(family, layers, **(FAST_WIDTH if fast else {}))
    folder = cached_checkpoint(f"{family}_{'tiny' if fast else 'real'}_{layers}l", cfg, root)
    print(f"checkpoint: {describe(cfg)} at {folder}", flush=True)
    return folder, cfg


def measure_link(store: Any, profile: Any, repeats: int) -> dict[str, Any]:
    """One expert through the AsyncIO link (median of `repeats`), as GB/s and as a share of the link's peak."""
    from engine.calibrate import measure_transfers

    seconds = measure_transfers(store, synchronous=False, repeats=repeats)
    gbps = store.expert_bytes / seconds / 1e9
    peak = profile.host_link.peak_gbps
    share = gbps / peak
    return {"expert_mib": store.expert_bytes / 2**20, "transfer_ms": seconds * 1e3, "h2d_gbps": gbps,
            "link_profile": profile.name, "link_peak_gbps": peak, "share_of_peak": share,
            "table2_band": list(TABLE2_BAND), "within_table2": TABLE2_BAND[0] <= share <= TABLE2_BAND[1],
            "pinned_source": bool(store.pinned)}


def run_overrides(folder: Path, batch: int, prompt_len: int, gen_len: int, budget: float) -> list[str]:
    return [f"model.checkpoint={folder}", "model.arch=null", "model.name=gpu_check", f"workload.batch_size={batch}",
            "workload.num_batches=1", f"workload.prompt_len={prompt_len}", f"workload.gen_len={gen_len}",
            f"offload.budget_fraction={budget}", "profile_batches=1", "wandb.mode=disabled"]


def serve_policy(policy: str, overrides: list[str], loaded: Any, profile: Any, out: Path) -> dict[str, Any]:
    """engine.run's offloaded serving of `policy` with the calibrated profile, compared with the in-memory model."""
    from omegaconf import OmegaConf

    from conf import compose
    from core.telemetry import Telemetry
    from engine.run import compare_with_in_memory, serve_offloaded

    node = compose("run", [*overrides, f"scheduler={policy}"])
    rc = OmegaConf.to_object(node)
    with Telemetry(node, task="run", run_dir=out / policy) as tm:
        results, executor, outs, batches, wall = serve_offloaded(rc, (profile, {}), loaded, tm)
        if loaded.full is not None:
            results.update(compare_with_in_memory(loaded, batches, outs, executor, wall))
    keep = ("scheduler", "throughput_tok_s", "decode_latency_ms", "in_memory_throughput_tok_s", "offload_vs_in_memory",
            "tokens_match_in_memory", "cache_slots", "experts_total", "planning_ms", "decode_layer_breakdown",
            "cache_hit_rate", "ondemand_loads", "prefetches", "cpu_experts", "timer")
    return {k: results.get(k) for k in keep}


def simulated_step(policy: str, cfg: Any, profile: Any, batch: int, prompt_len: int, gen_len: int,
                   cache_slots: int) -> dict[str, Any]:
    """The simulator's decode step for `policy` on this model with the calibrated profile (synthetic routing, the
    oracle predictor at the measured hit rate: the simulator's defaults)."""
    from conf import compose
    from engine.sim.run import prepare_routing, simulate
    from engine.simulate import spec_from_config

    node = compose("simulate", [f"scheduler={policy}", "model=mixtral_tiny", f"batch_size={batch}",
                                f"prompt_len={prompt_len}", f"gen_len={gen_len}", "wandb.mode=disabled"])
    spec = dataclasses.replace(spec_from_config(node), model=cfg, model_name="gpu_check", hardware=profile,
                               cache_slots=cache_slots, bytes_per_param=2)
    summary = simulate(spec, prepare_routing(spec)).summary
    return {"decode_latency_ms": 1e3 * summary["decode_latency_s"], "throughput_tok_s": summary["throughput_tok_s"],
            "routing": spec.routing.name, "predictor": spec.predictor.name if spec.predictor else "none"}


class Deadline:
    """Stages run while time is left; SIGALRM interrupts one that runs past the deadline (main thread only)."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds
        self.skipped: dict[str, str] = {}

    def left(self) -> float:
        return self.end - time.monotonic()

    def stage(self, name: str, fn: Callable[[], Any], need_s: float = 0.0) -> Optional[Any]:
        if self.left() <= need_s:
            self.skipped[name] = f"not started: {self.left():.0f} s left of the deadline"
            return None
        print(f"[gpu_check] {name} ({self.left():.0f} s left)", flush=True)

        def expire(*_: Any) -> None:
            raise StageTimeout(name)

        armed = threading.current_thread() is threading.main_thread()  # signals reach the main thread only
        old = signal.signal(signal.SIGALRM, expire) if armed else None
        if armed:
            signal.setitimer(signal.ITIMER_REAL, max(self.left(), 1.0))
        try:
            return fn()
        except StageTimeout:
            self.skipped[name] = "interrupted at the deadline"
            return None
        finally:
            if armed:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, old)


def check(family: str = "mixtral", layers: int = 2, fast: bool = False, batch: int = 4, prompt_len: int = 64,
          gen_len: int = 16, budget: float = 0.25, repeats: int = 5, deadline_s: float = 540.0,
          out: Path = Path("runs/gpu_check"), keep: bool = False) -> dict[str, Any]:
    """Every stage of the check; returns results.json's content (also written to `out`)."""
    from engine.calibrate import calibrate
    from engine.run import load_offload_model
    from models.loading import ModelSpec
    from schedulers.hardware import load_hardware

    started = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    clock = Deadline(deadline_s)
    device = device_report()
    results: dict[str, Any] = {"device": device, "fast": fast, "family": family, "layers": layers, "batch_size": batch,
                               "prompt_len": prompt_len, "gen_len": gen_len, "budget_fraction": budget}
    folder, cfg = build_checkpoint(family, layers, fast, out / "checkpoints")
    try:
        spec = ModelSpec(name="gpu_check", checkpoint=str(folder), arch=None)
        loaded = load_offload_model(spec, "auto", True, 0)  # the in-memory model too: tokens and the calibration
        results["dtype"] = np.dtype(loaded.dtype).name
        peak_profile = load_hardware(link_profile(device))
        results["link"] = clock.stage("link", lambda: measure_link(loaded.store, peak_profile, repeats))

        def calibrated() -> Any:
            profile, raw = calibrate(loaded.cfg, loaded.full, loaded.store, "gpu_check", "gpu_check", repeats=3,
                                     batch=batch, prompt_len=prompt_len, new_tokens=min(gen_len, 8))
            from engine.calibrate import profile_yaml
            (out / "gpu_check_profile.yaml").write_text(profile_yaml(profile, "engine.bench.gpu_check"))
            results["calibration"] = raw
            return profile

        profile = clock.stage("calibrate", calibrated) or peak_profile
        results["profile_used"] = "calibrated" if "calibration" in results else peak_profile.name
        overrides = run_overrides(folder, batch, prompt_len, gen_len, budget)
        policies = list(dict.fromkeys([default_policy(), *POLICIES]))
        results["default_policy"] = policies[0]
        served: dict[str, Any] = {}
        for policy in policies:
            row = clock.stage(f"serve {policy}", lambda p=policy: serve_policy(p, overrides, loaded, profile, out))
            if row is None:
                continue
            sim = clock.stage(f"simulate {policy}", lambda p=policy, r=row: simulated_step(
                p, loaded.cfg, profile, batch, prompt_len, gen_len, r["cache_slots"]))
            if sim is not None and row.get("decode_latency_ms"):
                sim["over_measured"] = sim["decode_latency_ms"] / row["decode_latency_ms"]
            row["simulated"] = sim
            served[policy] = row
        results["policies"] = served
        base = served.get(policies[0], {}).get("throughput_tok_s")
        for row in served.values():
            row["vs_default"] = row["throughput_tok_s"] / base if base else None
        results["tokens_match_in_memory"] = all(r.get("tokens_match_in_memory") is True for r in served.values()) \
            if served else None
    finally:
        if not keep:
            shutil.rmtree(out / "checkpoints", ignore_errors=True)
    results["skipped"] = clock.skipped
    results["wall_s"] = time.perf_counter() - started
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    return results


def summary_table(results: dict[str, Any]) -> str:
    """The check's one table: the link, then one row per policy."""
    d, link = results["device"], results.get("link") or {}
    lines = [f"gpu_check on {d['platform']}:{d['device_kind']} (pinned_host={d['pinned_host']}), {results['family']} "
             f"{'tiny' if results['fast'] else 'real'} width, {results['layers']} layers, {results.get('dtype')}, "
             f"batch {results['batch_size']}, {results['wall_s']:.0f} s"]
    if link:
        lines.append(f"host->device: {link['h2d_gbps']:.2f} GB/s per {link['expert_mib']:.1f}-MiB expert = "
                     f"{100 * link['share_of_peak']:.0f} % of {link['link_profile']}'s {link['link_peak_gbps']:.1f} GB/s "
                     f"(LayerScope Table 2: 66-80 %; within: {link['within_table2']})")
    lines.append(f"{'policy':<12}{'tok/s':>9}{'x default':>10}{'step ms':>9}{'sim/meas':>9}{'plan ms p50/p99':>17}"
                 f"{'own ms/layer':>13}{'tokens ok':>10}")
    for name, r in (results.get("policies") or {}).items():
        plan = (r.get("planning_ms") or {}).get("decode", {})
        sim = r.get("simulated") or {}
        own = (r.get("decode_layer_breakdown") or {}).get("executor_own_ms")
        lines.append(f"{name:<12}{r['throughput_tok_s']:>9.1f}{(r.get('vs_default') or 0):>10.2f}"
                     f"{(r.get('decode_latency_ms') or 0):>9.1f}{sim.get('over_measured', float('nan')):>9.2f}"
                     f"{plan.get('median_ms', float('nan')):>8.3f}/{plan.get('p99_ms', float('nan')):<8.3f}"
                     f"{(own if own is not None else float('nan')):>13.3f}{str(r.get('tokens_match_in_memory')):>10}")
    if results.get("skipped"):
        lines.append(f"skipped: {results['skipped']}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="mixtral", help="real-width preset (engine.bench.real_width.PRESETS)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of the truncated checkpoint")
    ap.add_argument("--fast", action="store_true", help="tiny width (any backend; CI)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=16)
    ap.add_argument("--budget", type=float, default=0.25, help="offload.budget_fraction of the routed experts")
    ap.add_argument("--repeats", type=int, default=5, help="transfers timed for the bandwidth (median)")
    ap.add_argument("--deadline-s", type=float, default=540.0, help="no stage starts or runs past this")
    ap.add_argument("--out", type=Path, default=Path("runs/gpu_check"))
    ap.add_argument("--keep", action="store_true", help="keep the built checkpoint")
    a = ap.parse_args(argv)
    results = check(a.family, a.layers, a.fast, a.batch, a.prompt_len, a.gen_len, a.budget, a.repeats, a.deadline_s,
                    a.out, a.keep)
    print(summary_table(results))
    print(f"results: {a.out / 'results.json'}")
    return results


if __name__ == "__main__":
    main()
