"""Oracle (MoEless §6.1, after He et al.): perfect expert load balance by ignoring the router.

Upper-bound baseline: the experts sit where static expert parallelism puts them (one replica each,
the paper's "full expert memory footprint", Fig. 14), but the tokens of every layer are spread
evenly over all experts whatever the gate chose. Every device then serves W / G tokens, the least
any placement can give its busiest device, so when a device's compute time sums over its replicas
(`conf/serverless/paper.yaml`, MoEless §4.3) no system is faster. It changes the model's output (it
is *lossy*), which every result that includes it must say.

`balanced_reroute` is the re-routing the real executor applies: assignment slot (t, j) goes to
expert (t * k + j) mod E, so the loads differ by at most one token and a token's k experts stay
distinct (k <= E).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from schedulers.ep_placement import Placement, ReplicaSettings, register
from schedulers.serverless.static_ep import StaticEPPolicy


def uniform_loads(actual: np.ndarray) -> np.ndarray:
    """float64 [E]: the total load spread evenly over the E experts."""
    a = np.asarray(actual, dtype=np.float64)
    return np.full(a.shape, a.sum() / a.size)


def balanced_reroute(num_tokens: int, top_k: int, num_experts: int) -> np.ndarray:
    """int64 [T, k]: the experts the Oracle sends each (token, slot) to."""
    if top_k > num_experts:
        raise ValueError(f"oracle: top_k={top_k} exceeds num_experts={num_experts}")
    return (np.arange(num_tokens * top_k, dtype=np.int64) % num_experts).reshape(num_tokens, top_k)


@dataclass(frozen=True)
class OracleBalanceSettings(ReplicaSettings):
    """No knobs of its own: static placement, one replica per expert."""

    kind: str = "oracle"
    label: str = "Oracle (lossy)"


@register("oracle", settings=OracleBalanceSettings)
class OracleBalancePolicy(StaticEPPolicy):
    """Static placement, routing replaced by an even spread (lossy)."""

    lossy = True

    def __init__(self, num_experts: int, num_devices: int, name: str = "Oracle (lossy)"):
        super().__init__(num_experts, num_devices, name)
        base = self.placement
        self.placement = Placement(base.num_experts, base.num_devices, base.replica_expert, base.replica_device,
                                   lossy=True)

    def effective_loads(self, actual: np.ndarray) -> np.ndarray:
        return uniform_loads(actual)
