"""Schema of the `routing` group: where the simulator's expert routing comes from.

- `synthetic`: `engine.synthetic_routing` with per-layer-group skew, inter-layer correlation and
  temporal locality (`synthetic.*`); `model_seed` fixes the hot experts, the run's `seed` the traffic.
- `trace`: a recorded routing trace (`core.trace` .npz) at `path`.
- `jsonl`: a vLLM-style JSONL routing log at `path` (one line per sequence, token and layer).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

from core.config import unfrozen, store
from engine.synthetic_routing import SyntheticRoutingParams


class RoutingSource(enum.Enum):
    synthetic = "synthetic"
    trace = "trace"
    jsonl = "jsonl"


@dataclass
class RoutingConfig:
    name: str = "synthetic"
    source: RoutingSource = RoutingSource.synthetic
    path: Optional[str] = None  # trace / jsonl file (pkg:<path> inside the repository)
    model_seed: int = 0  # synthetic: the fixed "model" (popularity, affinity maps)
    synthetic: unfrozen(SyntheticRoutingParams) = field(default_factory=unfrozen(SyntheticRoutingParams))  # type: ignore[valid-type]


store(RoutingConfig, name="base_routing", group="routing")
