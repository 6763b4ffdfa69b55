"""What an offloaded run measures, simulated or real (LayerScope §5.1 metrics plus the pipeline's internals).

Throughput as the paper defines it: tokens generated / generation time, prefill included.
Per-token decode latency: mean duration of a decode pass (every sequence gains one token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class RunMetrics:
    num_layers: int
    prefill_s: float = 0.0
    decode_s: float = 0.0
    total_s: float = 0.0
    n_prefill: int = 0
    n_decode: int = 0
    link_busy_s: float = 0.0
    bytes_moved: int = 0
    n_ondemand_transfers: int = 0
    n_prefetch_transfers: int = 0
    prefetch_used: int = 0
    prefetch_issued: int = 0
    active_decode: int = 0
    available_decode: int = 0
    active_prefill: int = 0
    available_prefill: int = 0
    predictor_hit_rate: dict[int, float] = field(default_factory=dict)
    # per MoE layer, decode passes summed
    layer_s: np.ndarray = field(init=False)
    gpu_busy_s: np.ndarray = field(init=False)
    cpu_busy_s: np.ndarray = field(init=False)
    n_cpu_experts: np.ndarray = field(init=False)
    n_gpu_experts: np.ndarray = field(init=False)
    n_ondemand: np.ndarray = field(init=False)
    n_prefetch: np.ndarray = field(init=False)
    prefill_gpu_busy_s: float = 0.0
    prefill_cpu_busy_s: float = 0.0
    pass_s: list[float] = field(default_factory=list)  # duration of every forward pass, in order
    n_fused_prefill: int = 0  # passes run as one device call over a full cache (no per-layer figures)
    n_fused_decode: int = 0

    def __post_init__(self) -> None:
        L = self.num_layers
        self.layer_s = np.zeros(L)
        self.gpu_busy_s = np.zeros(L)
        self.cpu_busy_s = np.zeros(L)
        for name in ("n_cpu_experts", "n_gpu_experts", "n_ondemand", "n_prefetch"):
            setattr(self, name, np.zeros(L, dtype=np.int64))

    # ---- accumulation (per layer and transfer: engine.offload.accounting; per pass: the mechanisms) ------
    def add_transfer(self, seconds: float, prefetch: bool, nbytes: int) -> None:
        self.link_busy_s += seconds
        self.bytes_moved += nbytes
        if prefetch:
            self.n_prefetch_transfers += 1
        else:
            self.n_ondemand_transfers += 1

    def add_residency(self, prefill: bool, active: int, available: int) -> None:
        if prefill:
            self.active_prefill += active
            self.available_prefill += available
        else:
            self.active_decode += active
            self.available_decode += available

    def add_prefetch_outcome(self, used: int, issued: int) -> None:
        self.prefetch_used += used
        self.prefetch_issued += issued

    def add_layer(self, prefill: bool, layer: int, seconds: float, gpu_busy: float, cpu_busy: float, *,
                  n_cpu: int, n_gpu: int, n_ondemand: int, n_prefetch: int) -> None:
        if prefill:
            self.prefill_gpu_busy_s += gpu_busy
            self.prefill_cpu_busy_s += cpu_busy
            return
        self.layer_s[layer] += seconds
        self.gpu_busy_s[layer] += gpu_busy
        self.cpu_busy_s[layer] += cpu_busy
        self.n_cpu_experts[layer] += n_cpu
        self.n_gpu_experts[layer] += n_gpu
        self.n_ondemand[layer] += n_ondemand
        self.n_prefetch[layer] += n_prefetch

    def add_fused_passes(self, prefill: bool, count: int) -> None:
        if prefill:
            self.n_fused_prefill += count
        else:
            self.n_fused_decode += count

    def add_pass(self, prefill: bool, seconds: float) -> None:
        self.pass_s.append(float(seconds))
        if prefill:
            self.prefill_s += seconds
            self.n_prefill += 1
        else:
            self.decode_s += seconds
            self.n_decode += 1

    def finish(self, total_s: float, hit_rates: dict[int, float]) -> None:
        self.total_s = total_s
        self.predictor_hit_rate = dict(hit_rates)

    # ---- reporting ------------------------------------------------------------------------------
    @staticmethod
    def _ratio(a: float, b: float) -> float:
        return float(a) / float(b) if b else float("nan")

    def summary(self, tokens_generated: int) -> dict:
        """Scalars and per-layer lists for results.json (times in seconds)."""
        n_dec = max(self.n_decode - self.n_fused_decode, 1)  # the per-layer figures cover layer-by-layer passes
        per_layer = {
            "layer_ms": (self.layer_s / n_dec * 1e3).tolist(),
            "gpu_busy_ms": (self.gpu_busy_s / n_dec * 1e3).tolist(),
            "cpu_busy_ms": (self.cpu_busy_s / n_dec * 1e3).tolist(),
            "gpu_bubble_ms": ((self.layer_s - self.gpu_busy_s) / n_dec * 1e3).tolist(),
            "cpu_bubble_ms": ((self.layer_s - self.cpu_busy_s) / n_dec * 1e3).tolist(),
            "cpu_experts": (self.n_cpu_experts / n_dec).tolist(),
            "gpu_experts": (self.n_gpu_experts / n_dec).tolist(),
            "ondemand_loads": (self.n_ondemand / n_dec).tolist(),
            "prefetches": (self.n_prefetch / n_dec).tolist(),
        }
        return {
            "throughput_tok_s": self._ratio(tokens_generated, self.total_s),
            "decode_latency_s": self._ratio(self.decode_s, self.n_decode),
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "total_s": self.total_s,
            "tokens_generated": tokens_generated,
            "pcie_utilisation": self._ratio(self.link_busy_s, self.total_s),
            "gpu_busy_decode": self._ratio(float(self.gpu_busy_s.sum()), float(self.layer_s.sum())),
            "cpu_busy_decode": self._ratio(float(self.cpu_busy_s.sum()), float(self.layer_s.sum())),
            "cache_hit_rate": self._ratio(self.available_decode, self.active_decode),
            "cache_hit_rate_prefill": self._ratio(self.available_prefill, self.active_prefill),
            "prefetch_hit_rate": self._ratio(self.prefetch_used, self.prefetch_issued),
            "predictor_hit_rate": self.predictor_hit_rate.get(1, float("nan")),
            "predictor_hit_rate_by_distance": {str(d): r for d, r in sorted(self.predictor_hit_rate.items())},
            "bytes_moved": int(self.bytes_moved),
            "ondemand_transfers": self.n_ondemand_transfers,
            "prefetch_transfers": self.n_prefetch_transfers,
            "fused_decode_passes": self.n_fused_decode,
            "per_layer_decode": per_layer,
        }
