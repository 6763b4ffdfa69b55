"""The routed experts' format in the cost model (`model.expert_format`: bf16, q8_0, q4_k_m, ...).

A quantized expert changes three things the schedulers trade against each other:

- its bytes: what crosses the host link (`t_io`), what the device cache holds (slots for the same memory) and
  what a GPU GEMV streams. They follow the block types `models.quant.experts.layer_formats` gives each MoE layer
  (Q4_K_M: gate/up Q4_K, down Q6_K in llama.cpp's "more bits" layers and Q4_K elsewhere, with its fallbacks where
  rows are not whole 256-weight blocks), byte for byte as ggml lays the blocks out;
- its CPU time (eq. 2): the slope per token and the time to stream the weights once, each scaled against bf16 by
  the rates of moescope's native kernels measured per block type (`schedulers/data/block_rates.yaml`, which names
  the points it was fitted on and those it was checked on; a profile's `block_rates` overrides them for its
  machine). An expert's gate/up hold 2/3 of its weights and down 1/3, so a layer whose down has its own type
  takes the weighted mean of the two types' scales;
- its GPU compute: the GEMM dequantizes inside the kernel; `gpu_compute_scale` (assumed 1.0 in the data file:
  weight-only quantized GEMMs that dequantize in registers, such as Marlin or llama.cpp's MMQ, run at about the
  bf16 tensor-core rate) scales the compute side of the roofline; the streaming side follows the bytes.

The cost model is one set of per-expert numbers per model, so where the layers differ (Q4_K_M) the bytes and
scales are the mean over the MoE layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from models.config import ModelConfig

if TYPE_CHECKING:
    from schedulers.hardware import BlockRates, HardwareProfile

RATES_FILE = Path(__file__).resolve().parent / "data" / "block_rates.yaml"


@lru_cache(maxsize=1)
def measured_block_rates() -> dict[str, "BlockRates"]:
    """Block type -> its rates against bf16, as measured on moescope's development machine (RATES_FILE)."""
    from omegaconf import OmegaConf

    from schedulers.hardware import BlockRates

    node = OmegaConf.to_container(OmegaConf.load(RATES_FILE), resolve=True)
    assert isinstance(node, dict)
    return {str(name): BlockRates(**{k: float(v) for k, v in values.items()})
            for name, values in dict(node["rates"]).items()}


def block_rates(hw: "HardwareProfile", qtype: str) -> "BlockRates":
    """The rates of `qtype` blocks on `hw`: the profile's own `block_rates`, else the measured defaults."""
    rates = hw.block_rates.get(qtype) or measured_block_rates().get(qtype)
    if rates is None:
        raise ValueError(f"hardware {hw.name}: no CPU/GPU rates for {qtype} expert blocks in its block_rates or in "
                         f"{RATES_FILE.name} (known: {', '.join(sorted(measured_block_rates()))}); measure them with "
                         f"`python -m engine.bench.bench_cpu_experts --types-only --isa default --types bf16,{qtype}`")
    return rates


@dataclass(frozen=True)
class FormatCosts:
    """What an expert format does to one routed expert's costs (means over the MoE layers)."""

    name: str
    expert_bytes: float  # bytes of one expert in the format
    bf16_bytes: int  # the same expert in bf16 (what the scales are relative to)
    cpu_beta_scale: float = 1.0
    cpu_read_scale: float = 1.0
    gpu_compute_scale: float = 1.0

    def summary(self) -> dict[str, float | str]:
        return {"expert_format": self.name, "bytes_over_bf16": self.expert_bytes / self.bf16_bytes,
                "cpu_beta_scale": self.cpu_beta_scale, "cpu_read_scale": self.cpu_read_scale,
                "gpu_compute_scale": self.gpu_compute_scale}


def _layer_bytes(hidden: int, inter: int, gate_up: str, down: str) -> int:
    """One expert's bytes: gate and up [F, H] rows in `gate_up` blocks, down [H, F] rows in `down` blocks."""
    from models.quant.blocks import block_type  # jax: only where a format is asked for

    return 2 * inter * block_type(gate_up).row_bytes(hidden) + hidden * block_type(down).row_bytes(inter)


def expert_format_bytes(cfg: ModelConfig, expert_format: str, bytes_per_param: int = 2) -> float:
    """Bytes of one routed expert in `expert_format` (bf16: `bytes_per_param` per weight), the mean over the MoE
    layers where the format gives layers different blocks (Q4_K_M)."""
    from models.quant.experts import check_format, layer_formats  # flax: only where a format is asked for

    check_format(expert_format)
    if expert_format == "bf16":
        return float(cfg.expert_bytes(bytes_per_param))
    H, F = cfg.hidden_size, cfg.expert_intermediate_size
    sizes = [_layer_bytes(H, F, f.gate_up, f.down) for f in layer_formats(cfg, expert_format).values()]
    return sum(sizes) / len(sizes)


def format_costs(cfg: ModelConfig, hw: "HardwareProfile", expert_format: str, bytes_per_param: int = 2,
                 blocks: Optional[Sequence[Any]] = None) -> FormatCosts:
    """The bytes and the CPU / GPU scales of `expert_format` for `cfg`'s experts on `hw` (see the module docstring).
    `blocks`: each MoE layer's block types as a checkpoint holds them (`LayerFormat`s: a GGUF file's, a saved
    folder's), in place of those `expert_format` names (then only a label, e.g. `blocks_format`'s)."""
    bf16 = cfg.expert_bytes(bytes_per_param)
    if blocks is not None:
        layers = list(blocks)
        H, F = cfg.hidden_size, cfg.expert_intermediate_size
        nbytes = sum(_layer_bytes(H, F, f.gate_up, f.down) for f in layers) / len(layers)
    elif expert_format == "bf16":
        return FormatCosts("bf16", expert_format_bytes(cfg, expert_format, bytes_per_param), bf16)
    else:
        from models.quant.experts import layer_formats

        nbytes = expert_format_bytes(cfg, expert_format, bytes_per_param)
        layers = list(layer_formats(cfg, expert_format).values())

    def mean(attr: str) -> float:
        # gate and up hold 2 of an expert's 3 matrices of equal size, down the third
        per_layer = [(2 * getattr(block_rates(hw, f.gate_up), attr) + getattr(block_rates(hw, f.down), attr)) / 3
                     for f in layers]
        return math.fsum(per_layer) / len(per_layer)

    return FormatCosts(expert_format, nbytes, bf16, mean("cpu_beta_scale"), mean("cpu_read_scale"),
                       mean("gpu_compute_scale"))


def blocks_format(cfg: ModelConfig, blocks: Sequence[Any]) -> str:
    """A name for experts held in `blocks` (each MoE layer's `LayerFormat`): the `model.expert_format` preset that
    gives exactly these types (so a GGUF file llama.cpp wrote in Q4_K_M is `q4_k_m`), else the types joined, e.g.
    `q4_k+q6_k`. Measured profiles (`ExpertTimes.expert_format`) are matched by this name."""
    from models.quant.experts import EXPERT_FORMATS, layer_formats

    layers = list(blocks)
    for name in EXPERT_FORMATS[1:]:
        try:
            if list(layer_formats(cfg, name).values()) == layers:
                return name
        except ValueError:  # the preset's blocks do not fit these rows
            continue
    return "+".join(sorted({t for f in layers for t in (f.gate_up, f.down)}))
