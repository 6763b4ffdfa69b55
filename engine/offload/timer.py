"""The Timer of LayerScope §4.1: measured per-operation costs, fed back into the cost model online."""

from __future__ import annotations

import threading
from collections import defaultdict

import numpy as np

from schedulers.cost import CostModel


class Timer:
    """Collects measured transfer / CPU-expert / GPU-expert times and updates `cost` with each."""

    def __init__(self, cost: CostModel, expert_bytes: int, update_cost: bool = True):
        self.cost = cost
        self.expert_bytes = expert_bytes
        self.update_cost = update_cost
        self.samples: dict[str, list[float]] = defaultdict(list)
        self._lock = threading.Lock()

    def transfer(self, seconds: float) -> None:
        with self._lock:
            self.samples["transfer_s"].append(seconds)
            if self.update_cost:
                self.cost.update_transfer(seconds)

    def cpu(self, tokens: int, seconds: float) -> None:
        with self._lock:
            self.samples["cpu_s_per_expert"].append(seconds)
            self.samples["cpu_tokens"].append(float(tokens))
            if self.update_cost:
                self.cost.update_cpu(tokens, seconds)

    def gpu(self, tokens: int, seconds: float) -> None:
        with self._lock:
            self.samples["gpu_s_per_expert"].append(seconds)
            if self.update_cost:
                self.cost.update_gpu(tokens, seconds)

    def cpu_dispatch(self, seconds: float) -> None:
        """A layer's CPU side: wall time from hand-over to merged result minus its experts' compute."""
        with self._lock:
            self.samples["cpu_dispatch_s"].append(seconds)
            if self.update_cost:
                self.cost.update_cpu_dispatch(seconds)

    def layer_overhead(self, seconds: float) -> None:
        """Fixed host time of one MoE layer: its wall time up to the issued plan minus the modelled attention."""
        with self._lock:
            self.samples["layer_overhead_s"].append(seconds)
            if self.update_cost:
                self.cost.update_layer_overhead(seconds)

    def pass_overhead(self, seconds: float) -> None:
        """Fixed host time of one forward pass outside its MoE layers minus the modelled dense layers and head."""
        with self._lock:
            self.samples["pass_overhead_s"].append(seconds)
            if self.update_cost:
                self.cost.update_pass_overhead(seconds)

    def summary(self) -> dict[str, float]:
        """Medians in milliseconds and the achieved transfer bandwidth."""
        out: dict[str, float] = {}
        with self._lock:
            for name, values in self.samples.items():
                if name.endswith("_s") or name.endswith("_per_expert"):
                    stem = name[:-2] if name.endswith("_s") else name.replace("_s_", "_")
                    out[f"{stem}_median_ms"] = float(np.median(values)) * 1e3
                    out[f"{stem}_count"] = len(values)
            if self.samples.get("transfer_s"):
                out["transfer_gbps"] = self.expert_bytes / float(np.median(self.samples["transfer_s"])) / 1e9
        return out
