"""Check the serverless layer time's physical constants against published absolute decode-step times.

    python engine/bench/check_decode_published.py [--hardware a6000]

For each point of `engine/data/ep_decode_published.yaml` the decode step is modelled with the offload
simulator's `CostModel` on the `--hardware` profile with the point's GPU datasheet numbers swapped in
(compute rate, memory bandwidth): per layer the attention block plus `experts_per_layer` experts each
streaming their weights, plus the LM head. Printed: the modelled step with the profile's constants and with
no fixed costs (the weight-streaming floor), the published step, the error, and the fixed cost per GPU
block (kernel_overhead_us) the published figure implies. Nothing is fitted here (see the data file).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import sys

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from conf import compose  # noqa: E402  (the repository on the path first: run as a script)
from models.loading import resolve_model_config  # noqa: E402
from schedulers.cost import CostModel  # noqa: E402
from schedulers.hardware import HardwareProfile, load_hardware  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "engine" / "data" / "ep_decode_published.yaml"


def modelled_step_s(point: dict[str, Any], hw: HardwareProfile, overhead_us: float | None = None) -> tuple[float, int]:
    """(seconds of one decode step, GPU blocks it runs) for one published point on `hw` with its GPU's rates."""
    gpu = dataclasses.replace(hw.gpu, bf16_tflops=float(point["gpu"]["bf16_tflops"]),
                              hbm_gbps=float(point["gpu"]["hbm_gbps"]),
                              kernel_overhead_us=hw.gpu.kernel_overhead_us if overhead_us is None else overhead_us)
    cfg = resolve_model_config(compose("serve", [f"model={point['model']}"]).model)
    cm = CostModel(cfg, dataclasses.replace(hw, gpu=gpu), bytes_per_param=int(point["bytes_per_param"]))
    b, k = int(point["batch"]), int(point["experts_per_layer"])
    layers = cfg.num_hidden_layers
    step = layers * (cm.t_attn(b, int(point["context"])) + k * float(cm.t_g(max(1, b * cfg.num_experts_per_tok // k))))
    return step + cm.t_head(b), layers * (2 + k) + 1


def check(hardware: str = "a6000") -> list[dict[str, Any]]:
    hw = load_hardware(hardware)
    rows = []
    for p in yaml.safe_load(DATA.read_text())["points"]:
        ours, blocks = modelled_step_s(p, hw)
        floor, _ = modelled_step_s(p, hw, overhead_us=0.0)
        published = float(p["step_ms"]) * 1e-3
        rows.append({"id": p["id"], "published_ms": published * 1e3, "modelled_ms": ours * 1e3,
                     "error": ours / published - 1, "streaming_floor_ms": floor * 1e3,
                     "implied_kernel_overhead_us": (published - floor) / blocks * 1e6,
                     "profile_kernel_overhead_us": hw.gpu.kernel_overhead_us})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hardware", default="a6000")
    for row in check(ap.parse_args().hardware):
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
