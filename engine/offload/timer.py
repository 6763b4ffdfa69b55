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

    def summary(self) -> dict[str, float]:
        """Medians in milliseconds and the achieved transfer bandwidth."""
        out: dict[str, float] = {}
        with self._lock:
            for name, values in self.samples.items():
                if name.endswith("_s") or name.endswith("_per_expert"):
                    out[f"{name.replace('_s', '')}_median_ms"] = float(np.median(values)) * 1e3
                    out[f"{name.replace('_s', '')}_count"] = len(values)
            if self.samples.get("transfer_s"):
                out["transfer_gbps"] = self.expert_bytes / float(np.median(self.samples["transfer_s"])) / 1e9
        return out
