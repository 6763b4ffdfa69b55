"""Expert store: every routed expert's weights in host memory, for transfers and for CPU compute.

Each expert is kept as three host arrays, gate [H, F], up [H, F] and down [F, H] (kernels laid out
[in, out] like the NNX model), so AsyncIO can move the three projections as separate transfers.
Where the backend offers a `pinned_host` memory kind (CPU and CUDA backends of jax do) the arrays
are jax arrays in page-locked host memory: device transfers are DMA-able and, on the CPU backend,
`numpy_views` are zero-copy. Otherwise plain numpy arrays are kept. Nothing is ever put on the
device here: loading a checkpoint larger than the device budget is fine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from models.config import ModelConfig
from models.hf import CheckpointReader, iter_expert_arrays
from models.transformer import MoETransformer

PARTS = ("gate", "up", "down")


def pinned_sharding(device: Optional[jax.Device] = None) -> Optional[SingleDeviceSharding]:
    """A sharding in the device's page-locked host memory, or None where the backend has none."""
    device = device or jax.devices()[0]
    kinds = {m.kind for m in device.addressable_memories()}
    return SingleDeviceSharding(device, memory_kind="pinned_host") if "pinned_host" in kinds else None


@dataclass(frozen=True)
class ExpertKey:
    layer: int  # MoE-layer index (0 = first MoE layer)
    expert: int


class ExpertStore:
    """Host copies of the routed experts of every MoE layer, indexed by (MoE layer, expert)."""

    def __init__(self, cfg: ModelConfig, dtype: Any = np.float32, pinned: bool = True):
        self.cfg = cfg
        self.dtype = np.dtype(dtype)
        self.num_layers = len(cfg.moe_layers)
        self.num_experts = cfg.num_experts
        self._sharding = pinned_sharding() if pinned else None
        self._parts: dict[tuple[int, int], dict[str, Any]] = {}

    @property
    def pinned(self) -> bool:
        return self._sharding is not None

    @property
    def expert_bytes(self) -> int:
        return 3 * self.cfg.hidden_size * self.cfg.expert_intermediate_size * self.dtype.itemsize

    def put(self, layer: int, expert: int, gate_up: np.ndarray, down: np.ndarray) -> None:
        """Store one expert from the model layout (gate|up fused [H, 2F], down [F, H])."""
        F = self.cfg.expert_intermediate_size
        H = self.cfg.hidden_size
        if gate_up.shape != (H, 2 * F) or down.shape != (F, H):
            raise ValueError(f"expert ({layer}, {expert}): shapes {gate_up.shape}, {down.shape}; "
                             f"expected ({H}, {2 * F}), ({F}, {H})")
        parts = {"gate": gate_up[:, :F], "up": gate_up[:, F:], "down": down}
        self._parts[(layer, expert)] = {name: self._host(arr) for name, arr in parts.items()}

    def _host(self, arr: np.ndarray) -> Any:
        arr = np.ascontiguousarray(np.asarray(arr).astype(self.dtype, copy=False))
        return jax.device_put(arr, self._sharding) if self._sharding is not None else arr

    def part(self, layer: int, expert: int, name: str) -> Any:
        """The host array of one projection (`gate`, `up` or `down`): the source of a device transfer."""
        try:
            return self._parts[(layer, expert)][name]
        except KeyError:
            raise KeyError(f"expert store: no expert ({layer}, {expert}) part {name!r}") from None

    def numpy_views(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(gate, up, down) as numpy arrays (zero-copy for pinned arrays on the CPU backend)."""
        return tuple(np.asarray(self.part(layer, expert, p)) for p in PARTS)  # type: ignore[return-value]

    def __len__(self) -> int:
        return len(self._parts)

    def check_complete(self) -> None:
        missing = [(l, e) for l in range(self.num_layers) for e in range(self.num_experts) if (l, e) not in self._parts]
        if missing:
            raise ValueError(f"expert store: {len(missing)} experts missing, e.g. {missing[:4]}")

    def keys(self) -> Iterator[tuple[int, int]]:
        return iter(self._parts)

    # ---- construction ------------------------------------------------------------------------------
    @classmethod
    def from_model(cls, model: MoETransformer, dtype: Any = None, pinned: bool = True) -> "ExpertStore":
        """Copy the routed experts out of an in-memory model."""
        cfg = model.cfg
        store = cls(cfg, dtype or np.dtype(model.embed[...].dtype), pinned)
        for i, decoder_layer in enumerate(cfg.moe_layers):
            experts = model.layers[decoder_layer].moe.experts
            if experts is None:
                raise ValueError(f"decoder layer {decoder_layer} holds no experts to copy")
            gate_up, down = experts.arrays()
            for e in range(cfg.num_experts):
                store.put(i, e, np.asarray(gate_up[e]), np.asarray(down[e]))
        return store

    @classmethod
    def from_checkpoint(cls, folder: str | Path, cfg: ModelConfig, dtype: Any = np.float32,
                        pinned: bool = True) -> "ExpertStore":
        """Read every routed expert of an HF checkpoint straight into host memory, one at a time."""
        store = cls(cfg, dtype, pinned)
        moe_index = {layer: i for i, layer in enumerate(cfg.moe_layers)}
        pending: dict[tuple[int, int], dict[str, np.ndarray]] = {}
        for decoder_layer, expert, kind, arr in iter_expert_arrays(CheckpointReader(folder), cfg, dtype):
            key = (moe_index[decoder_layer], expert)
            pending.setdefault(key, {})[kind] = arr
            if len(pending[key]) == 2:
                parts = pending.pop(key)
                store.put(key[0], key[1], parts["gate_up"], parts["down"])
        store.check_complete()
        return store
