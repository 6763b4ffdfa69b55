"""Fit the serverless layer time's two uncertain constants on published decode steps; report the held-out error.

    python engine/bench/check_decode_published.py [--hardware a6000]

For each point of `engine/data/ep_decode_published.yaml` one batch-1 decode step is modelled with the offload
simulator's `CostModel` on the `--hardware` profile with the point's GPU datasheet numbers swapped in (compute
rate, memory bandwidth): every decoder layer's attention block, each MoE layer's `experts_per_layer` routed
experts and its shared experts, each dense layer's MLP, and the LM head, each streaming its weights. At batch 1
every block is memory-bound, so the step is exactly

    step = streaming_at_datasheet_bandwidth / hbm_efficiency + gpu_blocks * kernel_overhead

`fit` finds (hbm_efficiency, kernel_overhead_us) by least squares on the relative errors of the points with
`role: fit` only; every point is then reported at the profile's constants and at the fitted ones, with its
role, so the held-out error is the check. Nothing is written to the hardware profiles here.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path
from typing import Any

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from conf import compose  # noqa: E402  (the repository on the path first: run as a script)
from models.loading import resolve_model_config  # noqa: E402
from schedulers.cost import CostModel  # noqa: E402
from schedulers.hardware import HardwareProfile, load_hardware  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "engine" / "data" / "ep_decode_published.yaml"
ROLES = ("fit", "held_out")


def load_points(path: Path = DATA) -> list[dict[str, Any]]:
    """The published points, each with a known role (a one-line error naming the point otherwise)."""
    points = yaml.safe_load(path.read_text())["points"]
    for p in points:
        if p.get("role") not in ROLES:
            raise ValueError(f"{path}: point {p.get('id')!r}: role must be one of {ROLES}, got {p.get('role')!r}")
    return points


@functools.lru_cache(maxsize=None)
def model_config(name: str):
    """conf/model/<name>'s ModelConfig (composed once: a Hydra compose costs about a second)."""
    return resolve_model_config(compose("serve", [f"model={name}"]).model)


def point_cost_model(point: dict[str, Any], hw: HardwareProfile, efficiency: float | None = None,
                     overhead_us: float | None = None) -> CostModel:
    """The CostModel of the point's model on `hw` with its GPU's datasheet rates (and the constants, if given)."""
    gpu = dataclasses.replace(
        hw.gpu, bf16_tflops=float(point["gpu"]["bf16_tflops"]), hbm_gbps=float(point["gpu"]["hbm_gbps"]),
        hbm_efficiency=hw.gpu.hbm_efficiency if efficiency is None else efficiency,
        kernel_overhead_us=hw.gpu.kernel_overhead_us if overhead_us is None else overhead_us,
        call_overhead_us=0.0)  # CUDA launches are in kernel_overhead_us (the GPU profiles' call overhead is 0 too)
    return CostModel(model_config(str(point["model"])), dataclasses.replace(hw, gpu=gpu), bytes_per_param=int(point["bytes_per_param"]))


def modelled_step_s(point: dict[str, Any], hw: HardwareProfile, efficiency: float | None = None,
                    overhead_us: float | None = None) -> tuple[float, int]:
    """(seconds of one decode step, GPU blocks it runs) for one published point."""
    cm = point_cost_model(point, hw, efficiency, overhead_us)
    cfg = cm.cfg
    b, k, ctx = int(point["batch"]), int(point["experts_per_layer"]), int(point["context"])
    per_expert = max(1, b * cfg.num_experts_per_tok // k)
    moe = set(cfg.moe_layers)
    shared = cm.t_shared(b)
    step, blocks = cm.t_head(b), 1
    for layer in range(cfg.num_hidden_layers):
        step += cm.t_attn(b, ctx)
        blocks += 2  # t_attn counts two kernels
        if layer in moe:
            step += k * float(cm.t_g(per_expert)) + shared
            blocks += k + (1 if shared else 0)
        else:
            step += cm.t_dense_mlp(b)
            blocks += 1
    return step, blocks


def streaming_terms(point: dict[str, Any], hw: HardwareProfile) -> tuple[float, int]:
    """(seconds of weight and KV streaming at the datasheet bandwidth, GPU blocks): the step's two linear terms."""
    return modelled_step_s(point, hw, efficiency=1.0, overhead_us=0.0)


def fit(points: list[dict[str, Any]], hw: HardwareProfile) -> dict[str, Any]:
    """hbm_efficiency and kernel_overhead_us minimising the squared relative error over the `role: fit` points:
    step_i / published_i = (S_i / published_i) * (1 / efficiency) + (B_i / published_i) * overhead, linear in
    (1 / efficiency, overhead)."""
    fitted = [p for p in points if p["role"] == "fit"]
    if len(fitted) < 2:
        raise ValueError(f"{DATA}: two constants need at least two points with role: fit, got {len(fitted)}")
    rows = []
    for p in fitted:
        published = float(p["step_ms"]) * 1e-3
        s, blocks = streaming_terms(p, hw)
        rows.append([s / published, blocks / published])
    (inv_eff, overhead_s), *_ = np.linalg.lstsq(np.array(rows), np.ones(len(rows)), rcond=None)
    if inv_eff <= 0 or overhead_s < 0:
        raise ValueError(f"fit: the fitted points give no physical constants (1/efficiency {inv_eff:.3g}, "
                         f"overhead {overhead_s * 1e6:.3g} us)")
    return {"hbm_efficiency": float(1.0 / inv_eff), "kernel_overhead_us": float(overhead_s * 1e6),
            "fitted_on": [p["id"] for p in fitted]}


def check(hardware: str = "a6000", path: Path = DATA) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every point at the profile's constants and at the fitted ones, and the fit."""
    hw = load_hardware(hardware)
    points = load_points(path)
    constants = fit(points, hw)
    rows = []
    for p in points:
        published = float(p["step_ms"]) * 1e-3
        profile, blocks = modelled_step_s(p, hw)
        fitted, _ = modelled_step_s(p, hw, constants["hbm_efficiency"], constants["kernel_overhead_us"])
        floor, _ = streaming_terms(p, hw)
        rows.append({"id": p["id"], "role": p["role"], "published_ms": published * 1e3,
                     "profile_ms": profile * 1e3, "profile_error": profile / published - 1,
                     "fitted_ms": fitted * 1e3, "fitted_error": fitted / published - 1,
                     "datasheet_streaming_ms": floor * 1e3, "gpu_blocks": blocks})
    return rows, constants


def markdown(rows: list[dict[str, Any]], constants: dict[str, Any], hw: HardwareProfile) -> str:
    lines = [f"fitted on {', '.join(constants['fitted_on'])}: hbm_efficiency {constants['hbm_efficiency']:.3f}, "
             f"kernel_overhead_us {constants['kernel_overhead_us']:.2f} (profile {hw.name}: "
             f"{hw.gpu.hbm_efficiency:g}, {hw.gpu.kernel_overhead_us:g})", "",
             "| point | role | published ms | streaming at datasheet ms | GPU blocks | profile constants ms (error) "
             "| fitted constants ms (error) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['id']} | {r['role']} | {r['published_ms']:.2f} | {r['datasheet_streaming_ms']:.2f} | "
                     f"{r['gpu_blocks']} | {r['profile_ms']:.2f} ({r['profile_error']:+.1%}) | "
                     f"{r['fitted_ms']:.2f} ({r['fitted_error']:+.1%}) |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hardware", default="a6000")
    a = ap.parse_args()
    rows, constants = check(a.hardware)
    print(markdown(rows, constants, load_hardware(a.hardware)))


if __name__ == "__main__":
    main()
