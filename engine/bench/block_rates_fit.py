"""eq. 2 per ggml block type against bf16, fitted from `bench_cpu_experts --types-only` figures: what writes
`schedulers/data/block_rates.yaml` (`--rates-yaml`), standard library only, so that its test imports nothing heavy."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

MIXES = {"q4_k_m": ("q4_k", "q6_k")}  # (gate/up, down): Q4_K_M's experts in the layers it gives more bits
FIT_WIDTH = "mixtral"  # the width block_rates.yaml is fitted at (the simulated Figure-11 model's)
READ_ROW = 1  # eq. 2's intercept C: the time at m = 1 (one read of the weights)
SLOPE_ROWS = (16, 64)  # eq. 2's slope beta: between the times at these m (compute-bound)


def line(times: dict) -> tuple[float, float]:
    """(slope per token, intercept) of eq. 2 from times (seconds) by m: the slope between SLOPE_ROWS, the intercept
    the time at READ_ROW. The kernels overlap reading and computing, so the additive eq. 2 (the cost model's) is
    taken where either dominates: through two arbitrary points it gave a negative read time for q4_0."""
    lo, hi = SLOPE_ROWS
    return (times[hi]["seconds"] - times[lo]["seconds"]) / (hi - lo), times[READ_ROW]["seconds"]


def fit_block_rates(figures: dict) -> tuple[dict[str, dict[str, float]], list[str]]:
    """Per pure block type (not the q4_k_m mix): eq. 2's slope and intercept over bf16's at FIT_WIDTH (`line`), and
    lines checking them: at every (width, m), the type's time over bf16's as the scaled eq. 2 predicts it against
    the measured one (the q4_k_m mix from its two types, as schedulers/formats.py combines them)."""
    widths = figures["widths"]
    base = widths[FIT_WIDTH]["types"]
    a0, b0 = line(base["bf16"]["m"])
    rates: dict[str, dict[str, float]] = {}
    for label, cells in base.items():
        if "@" in label or "/" in label:
            continue
        a, b = line(cells["m"])
        rates[label] = {"cpu_beta_scale": max(a / a0, 1e-3), "cpu_read_scale": max(b / b0, 1e-3)}
    checks = []
    for name, width in widths.items():
        wa, wb = line(width["types"]["bf16"]["m"])
        for label, cells in width["types"].items():
            if "@" in label or label == "bf16":
                continue
            qtype, _, down = label.partition("/")
            gate = MIXES.get(qtype, (qtype,))[0]
            down = down or MIXES.get(qtype, (qtype, qtype))[1]
            if gate not in rates or down not in rates:
                continue
            beta = (2 * rates[gate]["cpu_beta_scale"] + rates[down]["cpu_beta_scale"]) / 3
            read = (2 * rates[gate]["cpu_read_scale"] + rates[down]["cpu_read_scale"]) / 3
            errs = []
            for m in sorted(cells["m"]):
                # what the cost model does with the scales: the bf16 eq. 2 of the width rescaled; compared as the
                # time over bf16's at the same (width, m), predicted against measured
                predicted = (wa * beta * m + wb * read) / (wa * m + wb)
                measured = cells["m"][m]["seconds"] / width["types"]["bf16"]["m"][m]["seconds"]
                errs.append(f"m{m} {predicted:.2f}/{measured:.2f}")
            checks.append(f"{name} {label}: " + ", ".join(errs))
    return rates, checks


def write_rates_yaml(path: str, figures: dict, command: str) -> None:
    """schedulers/data/block_rates.yaml from a types run (`--rates-yaml`): the fitted scales, the points they were
    fitted on and the check on the others, as comments."""
    rates, checks = fit_block_rates(figures)
    fitted = ", ".join(f"{k}" for k in figures["widths"])
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = ["# CPU rates of moescope's native expert kernels per ggml block type, relative to bf16 (schedulers/formats.py).",
             f"# Measured {stamp} on {platform.node() or 'this machine'} ({os.cpu_count()} CPUs), ISA path "
             f"{figures['isa']}, {figures['threads']} threads, under load (best of the rounds), by:",
             f"#   {command}",
             f"# Fitted at {FIT_WIDTH} width (H {figures['widths'][FIT_WIDTH]['hidden']}, F "
             f"{figures['widths'][FIT_WIDTH]['inter']}): eq. 2 (t = beta m + C) of each type and of bf16, beta from m = "
             f"{SLOPE_ROWS[0]} and {SLOPE_ROWS[1]},",
             f"# C the time at m = {READ_ROW}; cpu_beta_scale = beta / beta(bf16), cpu_read_scale = C / C(bf16). Checked at "
             f"every (width, m) measured ({fitted}):",
             "# the type's time over bf16's at the same (width, m), predicted by the scaled eq. 2 / measured (q4_k_m: gate/up",
             "# Q4_K, down Q6_K, from the two types' scales 2:1):"]
    lines += [f"#   {c}" for c in checks]
    lines += ["# gpu_compute_scale: ASSUMED 1.0 (not measured; no GPU here): a weight-only quantized GEMM that dequantizes",
              "# in registers (Marlin, llama.cpp's MMQ) runs at about the bf16 tensor-core rate; the GPU's streaming time",
              "# follows the format's bytes. q5_0 (llama.cpp's fallback for rows that are not whole 256-weight blocks) has",
              "# no native kernel to measure: ASSUMED q4_0's compute, with its read time scaled by its bytes (22 / 18).",
              "rates:"]
    for name, r in rates.items():
        lines.append(f"  {name}: {{cpu_beta_scale: {r['cpu_beta_scale']:.4f}, cpu_read_scale: {r['cpu_read_scale']:.4f}, "
                     f"gpu_compute_scale: 1.0}}")
    if "q4_0" in rates and "q5_0" not in rates:
        q4 = rates["q4_0"]
        lines.append(f"  q5_0: {{cpu_beta_scale: {q4['cpu_beta_scale']:.4f}, cpu_read_scale: "
                     f"{q4['cpu_read_scale'] * 22 / 18:.4f}, gpu_compute_scale: 1.0}}  # assumed, see above")
    Path(path).write_text("\n".join(lines) + "\n")
    print(f"block rates written to {path}:\n" + "\n".join(lines))
