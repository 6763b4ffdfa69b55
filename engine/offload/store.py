"""Expert store: every routed expert's weights in host memory, for transfers and for CPU compute.

Each expert is kept as its three projections in the checkpoint's own layout, gate [F, H], up [F, H]
and down [H, F] ([out, in], as HF and torch store them), so AsyncIO can move the three as separate
transfers and CPU experts multiply them without a transpose. Read from a checkpoint in its own dtype,
the arrays are views of the memory-mapped safetensors files: the store then allocates nothing, and
the operating system pages the experts in (and, under memory pressure, out) as the files' cache.
Where the device is not the host (a GPU), the store copies every expert once into page-locked host
memory (`pinned_host`) so transfers are DMA; on the CPU backend nothing is copied, since a "transfer"
is already a copy between two places in the same memory. A checkpoint stored in another dtype than
the run's is converted once, expert by expert. Nothing is ever put on the device here.

Quantized experts (`model.expert_format`, a saved quantized folder): each part is its ggml block bytes,
uint8 [rows, row bytes] (`put_quant`), views of the model's or the mapped file's blocks; transfers move
those bytes, and `formats` gives each MoE layer's block types (the device expert dequantizes them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from models.config import ModelConfig
from models.hf import OpenCheckpoint
from models.quant.blocks import QuantArray, block_type
from models.quant.experts import GateUp, LayerFormat, QuantExperts, split_gate_up
from models.transformer import MoETransformer

PARTS = ("gate", "up", "down")


def pinned_sharding(device: Optional[jax.Device] = None) -> Optional[SingleDeviceSharding]:
    """A sharding in the device's page-locked host memory, or None where the backend has none."""
    device = device or jax.devices()[0]
    kinds = {m.kind for m in device.addressable_memories()}
    return SingleDeviceSharding(device, memory_kind="pinned_host") if "pinned_host" in kinds else None


def wants_pinned(device: Optional[jax.Device] = None) -> bool:
    """Whether host experts should live in page-locked memory: only where the device is not the host."""
    device = device or jax.devices()[0]
    return device.platform != "cpu" and pinned_sharding(device) is not None


class ExpertStore:
    """Host arrays of the routed experts of every MoE layer, indexed by (MoE layer, expert)."""

    def __init__(self, cfg: ModelConfig, dtype: Any = np.float32, pinned: Optional[bool] = None):
        self.cfg = cfg
        self.dtype = np.dtype(dtype)
        self.num_layers = len(cfg.moe_layers)
        self.num_experts = cfg.num_experts
        self._sharding = pinned_sharding() if (wants_pinned() if pinned is None else pinned) else None
        self._parts: dict[tuple[int, int], dict[str, Any]] = {}
        self.allocated_bytes = 0  # host memory the store allocated itself (views of mapped files cost none)
        self.formats: dict[int, LayerFormat] = {}  # MoE layer -> block types, for quantized experts (else empty)

    @property
    def pinned(self) -> bool:
        return self._sharding is not None

    @property
    def quantized(self) -> bool:
        return bool(self.formats)

    def layer_expert_bytes(self, layer: int) -> int:
        """Bytes one expert of MoE layer `layer` moves (its blocks when quantized)."""
        H, F = self.cfg.hidden_size, self.cfg.expert_intermediate_size
        if not self.formats:
            return 3 * H * F * self.dtype.itemsize
        fmt = self.formats[layer]
        return 2 * F * block_type(fmt.gate_up).row_bytes(H) + H * block_type(fmt.down).row_bytes(F)

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert (the mean over layers where a quantized preset mixes block types)."""
        if not self.formats:
            return self.layer_expert_bytes(0)
        return round(sum(self.layer_expert_bytes(l) for l in range(self.num_layers)) / self.num_layers)

    def cost_format(self) -> dict[str, Any]:
        """The `CostModel` arguments of these experts' format: its name (`schedulers.formats.blocks_format`: the preset
        that gives these block types, else the types) and each MoE layer's block types; bf16 for float experts."""
        if not self.formats:
            return {"expert_format": "bf16"}
        from schedulers.formats import blocks_format

        blocks = [self.formats[m] for m in range(self.num_layers)]
        return {"expert_format": blocks_format(self.cfg, blocks), "expert_blocks": blocks}

    def layer_widths(self, layer: int) -> tuple[int, int]:
        """Row bytes of MoE layer `layer`'s quantized expert: (gate|up rows, down rows)."""
        H, F = self.cfg.hidden_size, self.cfg.expert_intermediate_size
        fmt = self.formats[layer]
        return block_type(fmt.gate_up).row_bytes(H), block_type(fmt.down).row_bytes(F)

    def slot_widths(self) -> tuple[int, int]:
        """Row bytes of a device slot able to hold any layer's quantized expert: (gate|up rows, down rows)."""
        widths = [self.layer_widths(layer) for layer in self.formats]
        return max(w[0] for w in widths), max(w[1] for w in widths)

    def put_quant(self, layer: int, expert: int, gate: QuantArray, up: QuantArray, down: QuantArray) -> None:
        """Store one quantized expert (MoE layer index): its three matrices' block bytes, kept as given (views)."""
        F, H = self.cfg.expert_intermediate_size, self.cfg.hidden_size
        if gate.shape != (F, H) or up.shape != (F, H) or down.shape != (H, F) or gate.qtype != up.qtype:
            raise ValueError(f"expert ({layer}, {expert}): quantized shapes {gate.shape}, {up.shape}, {down.shape} "
                             f"({gate.qtype}, {up.qtype}, {down.qtype}); expected ({F}, {H}) x2 sharing a type, ({H}, {F})")
        fmt = LayerFormat(gate.qtype, down.qtype)
        if self.formats.setdefault(layer, fmt) != fmt:
            raise ValueError(f"expert ({layer}, {expert}): {fmt} differs from its layer's {self.formats[layer]}")
        self._parts[(layer, expert)] = {name: self._host_bytes(q.data) for name, q in zip(PARTS, (gate, up, down))}

    def _host_bytes(self, data: Any) -> Any:
        host = np.asarray(data)
        if self._sharding is not None:
            self.allocated_bytes += host.nbytes
            return jax.device_put(np.ascontiguousarray(host), self._sharding)
        return host

    def put_layers(self, layers: dict[int, tuple[Sequence[GateUp], Sequence[QuantArray]]]) -> None:
        """Store quantized experts given per decoder layer as (gate|up list, down list) (`models.quant.experts.install`'s
        layout): every part kept as a view of its source's blocks."""
        moe_index = {layer: i for i, layer in enumerate(self.cfg.moe_layers)}
        for layer, (gate_up, down) in layers.items():
            for e, (gu, dn) in enumerate(zip(gate_up, down)):
                self.put_quant(moe_index[layer], e, *split_gate_up(gu), dn)

    def quant_views(self, layer: int, expert: int) -> tuple[QuantArray, QuantArray, QuantArray]:
        """(gate, up, down) of a quantized expert as `QuantArray`s over numpy views of its block bytes."""
        F, H = self.cfg.expert_intermediate_size, self.cfg.hidden_size
        fmt = self.formats[layer]
        gate, up, down = self.numpy_views(layer, expert)
        return (QuantArray(gate, fmt.gate_up, (F, H)), QuantArray(up, fmt.gate_up, (F, H)),
                QuantArray(down, fmt.down, (H, F)))

    def put(self, layer: int, expert: int, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> None:
        """Store one expert: gate [F, H], up [F, H], down [H, F] (kept as given when already in the store's
        dtype and contiguous, e.g. views of a mapped checkpoint)."""
        F, H = self.cfg.expert_intermediate_size, self.cfg.hidden_size
        if gate.shape != (F, H) or up.shape != (F, H) or down.shape != (H, F):
            raise ValueError(f"expert ({layer}, {expert}): shapes {gate.shape}, {up.shape}, {down.shape}; "
                             f"expected ({F}, {H}), ({F}, {H}), ({H}, {F})")
        self._parts[(layer, expert)] = {name: self._host(arr) for name, arr in zip(PARTS, (gate, up, down))}

    def _host(self, arr: np.ndarray) -> Any:
        host = np.ascontiguousarray(np.asarray(arr).astype(self.dtype, copy=False))
        if self._sharding is not None:
            self.allocated_bytes += host.nbytes
            return jax.device_put(host, self._sharding)
        if not np.shares_memory(host, arr):
            self.allocated_bytes += host.nbytes
        return host

    def part(self, layer: int, expert: int, name: str) -> Any:
        """The host array of one projection (`gate`, `up` or `down`): the source of a device transfer."""
        try:
            return self._parts[(layer, expert)][name]
        except KeyError:
            raise KeyError(f"expert store: no expert ({layer}, {expert}) part {name!r}") from None

    def numpy_views(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(gate, up, down) as numpy arrays (zero-copy: mapped files, or pinned arrays on the CPU backend)."""
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
    def from_model(cls, model: MoETransformer, dtype: Any = None, pinned: Optional[bool] = None) -> "ExpertStore":
        """The routed experts of an in-memory model (views of its arrays where the backend allows)."""
        cfg = model.cfg
        store = cls(cfg, dtype or np.dtype(model.run_dtype), pinned)
        F = cfg.expert_intermediate_size
        for i, decoder_layer in enumerate(cfg.moe_layers):
            experts = model.layers[decoder_layer].moe.experts
            if experts is None:
                raise ValueError(f"decoder layer {decoder_layer} holds no experts to copy")
            gate_up, down = experts.arrays()
            if isinstance(experts, QuantExperts):  # block bytes: views of the model's arrays (or its mapped file)
                for e, ((gate, up), dn) in enumerate(zip(gate_up, down)):
                    store.put_quant(i, e, *(QuantArray(np.asarray(q.data), q.qtype, q.shape) for q in (gate, up, dn)))
                continue
            for e in range(cfg.num_experts):
                gu = np.asarray(gate_up[e])
                store.put(i, e, gu[:F], gu[F:], np.asarray(down[e]))
        return store

    @classmethod
    def from_checkpoint(cls, checkpoint: OpenCheckpoint | str | Path, dtype: Any = None,
                        pinned: Optional[bool] = None) -> "ExpertStore":
        """Every routed expert of a checkpoint: views of its mapped files (converted copies when `dtype` differs from
        the stored one; default: the checkpoint's own dtype). Experts stored in ggml blocks (a saved quantized folder,
        a GGUF file) stay in their blocks, views of the mapping; `dtype` is then the run's (the store's `dtype`)."""
        if not isinstance(checkpoint, OpenCheckpoint):
            from models.loading import open_model_checkpoint  # an HF folder, a quantized folder or a GGUF file

            checkpoint = open_model_checkpoint({"checkpoint": str(checkpoint)})
        ck = checkpoint
        blocks = block_sources(ck)
        if blocks is not None:  # a saved quantized folder or a GGUF file's block experts: views of its mapping
            store = cls(ck.cfg, dtype or np.float32, pinned)
            store.put_layers(blocks)
            store.check_complete()
            return store
        store = cls(ck.cfg, dtype or ck.stored_dtype(), pinned)
        F = ck.cfg.expert_intermediate_size
        moe_index = {layer: i for i, layer in enumerate(ck.cfg.moe_layers)}
        pending: dict[tuple[int, int], list[np.ndarray]] = {}
        for src in ck.sources:
            if src.expert is None:
                continue
            key = (moe_index[src.expert[0]], src.expert[1])
            if src.path[-2] == "gate_up":
                views = [ck.reader.view(p) for p in src.pieces]
                pending[key] = views if len(views) == 2 else [views[0][:F], views[0][F:]]
            else:
                store.put(key[0], key[1], *pending.pop(key), ck.reader.view(src.pieces[0]))
        store.check_complete()
        return store


def block_sources(ck: OpenCheckpoint) -> Optional[dict[int, tuple[Sequence[GateUp], Sequence[QuantArray]]]]:
    """The routed experts of a checkpoint that stores them in ggml blocks (a folder written by `models.quant.save`,
    a GGUF file with quantized experts) as views of its mapped file, per decoder layer; None for float experts."""
    from models.gguf import block_experts
    from models.quant.checkpoint import mapped_experts, quantized_info

    if not stores_blocks(ck):
        return None
    return mapped_experts(ck.folder, ck.cfg) if quantized_info(ck.folder) is not None else block_experts(ck)


def stores_blocks(ck: OpenCheckpoint) -> bool:
    """Whether a checkpoint stores its routed experts in ggml blocks (headers only: nothing mapped or read)."""
    from models.gguf import has_block_experts
    from models.quant.checkpoint import quantized_info

    return quantized_info(ck.folder) is not None or has_block_experts(ck)
