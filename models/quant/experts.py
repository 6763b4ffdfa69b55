"""Quantized routed experts in the model: the `model.expert_format` presets, quantize-on-load, and the
module that holds an MoE layer's experts as ggml blocks.

`QuantExperts` stands where `RoutedExperts` stands (`model.layers[i].moe.experts`): per expert its
gate|up rows [2F, H] and down [H, F] as `QuantArray`s (uint8 block bytes on the device, type and shape
static). The in-memory executor computes them through `models.quant.matmul.expert_swiglu`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
from flax import nnx

from models.config import ModelConfig
from models.quant.blocks import QUANTIZED, QuantArray, block_type
from models.quant.formats import quantize

EXPERT_FORMATS = ("bf16", "q8_0", "q4_0", "q4_k", "q4_k_m", "q6_k")
"""`model.expert_format` values: `bf16` (the default: experts as the checkpoint stores them, in the run's
dtype), one ggml block type for every expert tensor, or `q4_k_m` (llama.cpp's Q4_K_M preset for experts)."""


def check_format(name: str) -> str:
    if name not in EXPERT_FORMATS:
        raise ValueError(f"model.expert_format={name!r} is not supported; supported: {', '.join(EXPERT_FORMATS)}")
    return name


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's rule (llama-quant.cpp) for the layers whose ffn_down gets more bits in the *_K_M presets: the
    first and last eighth of the layers and every third layer between them."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


@dataclasses.dataclass(frozen=True)
class LayerFormat:
    """The block types of one MoE layer's experts: gate and up share one, down has its own."""

    gate_up: str
    down: str


K_FALLBACK = {"q4_k": "q5_0", "q6_k": "q8_0"}
"""llama.cpp's replacement when a row is not a whole number of 256-weight K-quant blocks (llama-quant.cpp)."""


def fitting(qtype: str, cols: int, preset: bool, where: str) -> str:
    """`qtype` for rows of `cols` weights; in a preset, llama.cpp's fallback when they do not fit; else an error."""
    t = block_type(qtype)
    if cols % t.block_elems == 0:
        return qtype
    if preset and qtype in K_FALLBACK:
        return fitting(K_FALLBACK[qtype], cols, False, where)
    raise ValueError(f"model.expert_format: {where} has rows of {cols} weights, not a whole number of {qtype}'s "
                     f"{t.block_elems}-weight blocks")


def layer_formats(cfg: ModelConfig, expert_format: str) -> dict[int, LayerFormat]:
    """Decoder layer -> the block types `expert_format` gives its routed experts (MoE layers only).

    `q4_k_m` follows llama.cpp's Q4_K_M for MoE expert tensors: gate and up Q4_K; down Q6_K in the layers
    `use_more_bits(layer, num_hidden_layers)` picks (llama.cpp counts every block, dense ones included, and takes
    the layer from the tensor's name), Q4_K elsewhere; where rows are not a multiple of 256 weights, llama.cpp's
    fallbacks (Q4_K -> Q5_0, Q6_K -> Q8_0). A single block type whose blocks do not divide the rows is an error
    naming the tensor, before any weight is read."""
    check_format(expert_format)
    if expert_format == "bf16":
        return {}
    H, F = cfg.hidden_size, cfg.expert_intermediate_size
    preset = expert_format == "q4_k_m"
    out = {}
    for layer in cfg.moe_layers:
        if preset:
            gate_up, down = "q4_k", "q6_k" if use_more_bits(layer, cfg.num_hidden_layers) else "q4_k"
        else:
            gate_up = down = expert_format
        out[layer] = LayerFormat(fitting(gate_up, H, preset, f"layer {layer} experts' gate/up [{F}, {H}]"),
                                 fitting(down, F, preset, f"layer {layer} experts' down [{H}, {F}]"))
    return out


class ExpertBlocks(nnx.Variable):
    """The uint8 block bytes of one quantized expert matrix (not a trainable parameter)."""


GateUp = Union[QuantArray, tuple[QuantArray, QuantArray]]
"""One expert's gate and up projections: one [2F, H] matrix (gate rows first) or a (gate [F, H], up [F, H]) pair
(a GGUF file's separate tensors, kept as views of the file: concatenating them would copy them)."""


def split_gate_up(gu: GateUp) -> tuple[QuantArray, QuantArray]:
    """(gate, up) of a `GateUp`; a [2F, H] matrix is split into two row views (numpy data: no copy)."""
    if isinstance(gu, tuple):
        return gu
    F = gu.shape[0] // 2
    return (QuantArray(gu.data[:F], gu.qtype, (F, gu.shape[1])), QuantArray(gu.data[F:], gu.qtype, (F, gu.shape[1])))


class QuantExperts(nnx.Module):
    """The routed experts of one layer as ggml blocks: per expert gate [F, H], up [F, H] (one block type) and
    down [H, F]; `arrays()` gives each expert's gate|up as the pair (gate, up)."""

    def __init__(self, gate_up: Sequence[GateUp], down: Sequence[QuantArray]):
        if not gate_up or len(gate_up) != len(down):
            raise ValueError(f"QuantExperts: {len(gate_up)} gate|up and {len(down)} down matrices")
        pairs = [split_gate_up(gu) for gu in gate_up]
        self.gate_up_type, self.half_shape = pairs[0][0].qtype, tuple(pairs[0][0].shape)
        self.down_type, self.down_shape = down[0].qtype, tuple(down[0].shape)
        for g, u in pairs:
            self._same(g, self.gate_up_type, self.half_shape, "gate")
            self._same(u, self.gate_up_type, self.half_shape, "up")
        for q in down:
            self._same(q, self.down_type, self.down_shape, "down")
        self.gate = nnx.List([ExpertBlocks(g.data) for g, _ in pairs])
        self.up = nnx.List([ExpertBlocks(u.data) for _, u in pairs])
        self.down = nnx.List([ExpertBlocks(q.data) for q in down])

    @staticmethod
    def _same(q: QuantArray, qtype: str, shape: tuple, what: str) -> None:
        if q.qtype != qtype or tuple(q.shape) != shape:
            raise ValueError(f"QuantExperts: every {what} matrix of a layer must be {qtype} {shape}, got {q.qtype} {q.shape}")

    @property
    def num_experts(self) -> int:
        return len(self.gate)

    @property
    def gate_up_shape(self) -> tuple[int, int]:
        return 2 * self.half_shape[0], self.half_shape[1]

    @property
    def nbytes(self) -> int:
        return sum(int(v[...].nbytes) for v in list(self.gate) + list(self.up) + list(self.down))

    def arrays(self) -> tuple[list[tuple[QuantArray, QuantArray]], list[QuantArray]]:
        """Per expert (gate, up) and down as `QuantArray`s over the module's arrays."""
        t, hs = self.gate_up_type, self.half_shape
        return ([(QuantArray(g[...], t, hs), QuantArray(u[...], t, hs)) for g, u in zip(self.gate, self.up)],
                [QuantArray(v[...], self.down_type, self.down_shape) for v in self.down])


@dataclasses.dataclass(frozen=True)
class QuantStack:
    """One projection of every expert of a layer in ggml blocks, stacked: data uint8 [E, rows, row_bytes] holding E
    matrices of `shape` = (rows, cols) weights (a GGUF file's `blk.N.ffn_{gate,up,down}_exps.weight`, mapped)."""

    data: Any
    qtype: str
    shape: tuple[int, int]

    def expert(self, e: int) -> QuantArray:
        return QuantArray(self.data[e], self.qtype, self.shape)


class StackedQuantExperts(QuantExperts):
    """`QuantExperts` held as three stacked arrays per layer, gate and up [E, F, row_bytes] and down [E, H, row_bytes]
    (`QuantStack`s: a GGUF file's expert tensors, views of the mapping), where `QuantExperts` holds 3E arrays.

    Why: every array of the model is a parameter of the programs that run it, and XLA:CPU keeps per-parameter
    state in each compiled executable; with 3E arrays per MoE layer that grew a Qwen3-30B-A3B-shaped program's
    anonymous memory by ~5 MB per layer (prefill and decode alike), ~0.5 GB per batch size compiled at 48 layers.
    The in-memory executor hands the stacks to the native kernel whole (`models.native.qexperts_stacked`);
    `arrays()` gives per-expert views for every other consumer."""

    def __init__(self, gate: QuantStack, up: QuantStack, down: QuantStack):  # noqa: D107 - no per-expert lists
        E = int(gate.data.shape[0])
        if gate.qtype != up.qtype or gate.shape != up.shape or int(up.data.shape[0]) != E or int(down.data.shape[0]) != E:
            raise ValueError(f"StackedQuantExperts: gate {gate.qtype} {tuple(gate.data.shape)}, up {up.qtype} "
                             f"{tuple(up.data.shape)}, down {tuple(down.data.shape)}: expected one type and E for gate and up")
        self.gate_up_type, self.half_shape = gate.qtype, tuple(gate.shape)
        self.down_type, self.down_shape = down.qtype, tuple(down.shape)
        self.gate, self.up, self.down = ExpertBlocks(gate.data), ExpertBlocks(up.data), ExpertBlocks(down.data)

    @property
    def num_experts(self) -> int:
        return int(self.gate[...].shape[0])

    @property
    def nbytes(self) -> int:
        return sum(int(v[...].nbytes) for v in (self.gate, self.up, self.down))

    def stacks(self) -> tuple[Any, Any, Any]:
        """(gate, up, down) block arrays [E, rows, row_bytes]."""
        return self.gate[...], self.up[...], self.down[...]

    def arrays(self) -> tuple[list[tuple[QuantArray, QuantArray]], list[QuantArray]]:
        """Per expert (gate, up) and down `QuantArray`s: numpy views of the stacks outside a trace (no copy), slices
        inside one (XLA's own strategies, off the CPU)."""
        import jax

        arrays = self.stacks()
        if not any(isinstance(a, jax.core.Tracer) for a in arrays):
            arrays = tuple(np.asarray(a) for a in arrays)
        g, u, d = (QuantStack(a, t, sh) for a, t, sh in zip(arrays, (self.gate_up_type,) * 2 + (self.down_type,),
                                                             (self.half_shape,) * 2 + (self.down_shape,)))
        E = self.num_experts
        return [(g.expert(e), u.expert(e)) for e in range(E)], [d.expert(e) for e in range(E)]


def install_stacks(model: nnx.Module, layers: dict[int, tuple[QuantStack, QuantStack, QuantStack]]) -> None:
    """Put stacked quantized experts in `model` (decoder layer -> (gate, up, down) `QuantStack`s); host arrays go to
    the device (aliased, not copied, on the CPU backend)."""
    import jax

    for layer, stacks in layers.items():
        data = jax.device_put([np.asarray(q.data) if not isinstance(q.data, jax.Array) else q.data for q in stacks],
                              may_alias=True)
        model.layers[layer].moe.experts = nnx.data(StackedQuantExperts(
            *(dataclasses.replace(q, data=d) for q, d in zip(stacks, data))))


ExpertSource = Callable[[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]]
"""(decoder layer, expert) -> (gate [F, H], up [F, H], down [H, F]) float weights (e.g. views of a mapped checkpoint)."""


def quantize_expert(gate: np.ndarray, up: np.ndarray, down: np.ndarray, fmt: LayerFormat, where: str
                    ) -> tuple[QuantArray, QuantArray]:
    """One expert's (gate|up [2F, H], down [H, F]) in `fmt`'s blocks, from float weights; `where` names it in errors."""
    F, H = gate.shape
    gu = np.concatenate([quantize(gate, fmt.gate_up, f"{where} gate"), quantize(up, fmt.gate_up, f"{where} up")])
    return QuantArray(gu, fmt.gate_up, (2 * F, H)), QuantArray(quantize(down, fmt.down, f"{where} down"), fmt.down, (H, F))


def quantized_layers(cfg: ModelConfig, expert_format: str, source: ExpertSource
                     ) -> dict[int, tuple[list[QuantArray], list[QuantArray]]]:
    """Every MoE layer's experts quantized to `expert_format`, expert by expert (one expert's floats at a time)."""
    out = {}
    for layer, fmt in layer_formats(cfg, expert_format).items():
        pairs = [quantize_expert(*source(layer, e), fmt, f"layer {layer} expert {e}") for e in range(cfg.num_experts)]
        out[layer] = ([p[0] for p in pairs], [p[1] for p in pairs])
    return out


def install(model: nnx.Module, layers: dict[int, tuple[Sequence[GateUp], Sequence[QuantArray]]]) -> None:
    """Put quantized experts in `model` (decoder layer -> (gate|up list, down list)); host arrays go to the device
    (aliased, not copied, on the CPU backend: a [2F, H] gate|up is split into row views on the host first)."""
    import jax

    for layer, (gate_up, down) in layers.items():
        pairs = [split_gate_up(gu) for gu in gate_up]
        flat = [q for pair in pairs for q in pair] + list(down)
        data = jax.device_put([np.asarray(q.data) if not isinstance(q.data, jax.Array) else q.data for q in flat],
                              may_alias=True)
        placed = [dataclasses.replace(q, data=d) for q, d in zip(flat, data)]
        n = 2 * len(pairs)
        model.layers[layer].moe.experts = nnx.data(QuantExperts(
            [(placed[i], placed[i + 1]) for i in range(0, n, 2)], placed[n:]))


def model_source(model: nnx.Module) -> ExpertSource:
    """The float experts of an in-memory model (random weights, or a model loaded in bf16) as an `ExpertSource`."""
    F = model.cfg.expert_intermediate_size

    def source(layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        experts = model.layers[layer].moe.experts
        gu = np.asarray(experts.gate_up[expert][...], np.float32)
        return gu[:F], gu[F:], np.asarray(experts.down[expert][...], np.float32)

    return source


def checkpoint_source(ck: Any) -> ExpertSource:
    """The float experts of an opened HF checkpoint (`models.hf.OpenCheckpoint`): views of its mapped files."""
    F = ck.cfg.expert_intermediate_size
    where: dict[tuple[int, int], dict[str, Any]] = {}
    for src in ck.sources:
        if src.expert is not None:
            where.setdefault(src.expert, {})[src.path[-2]] = src

    def source(layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        parts = where[(layer, expert)]
        views = [ck.reader.view(p) for p in parts["gate_up"].pieces]
        gate, up = (views[0][:F], views[0][F:]) if len(views) == 1 else views
        return gate, up, ck.reader.view(parts["down"].pieces[0])

    return source


def quantized_model_format(model: nnx.Module) -> Optional[dict[int, LayerFormat]]:
    """Decoder layer -> block types of a model's quantized experts, or None when its experts are not quantized."""
    out = {}
    for layer in model.cfg.moe_layers:
        experts = model.layers[layer].moe.experts
        if isinstance(experts, QuantExperts):
            out[layer] = LayerFormat(experts.gate_up_type, experts.down_type)
    return out or None


__all__ = ["EXPERT_FORMATS", "QUANTIZED", "LayerFormat", "QuantExperts", "StackedQuantExperts", "QuantStack",
           "install_stacks", "ExpertBlocks", "check_format",
           "install", "layer_formats", "model_source", "quantize_expert", "quantized_layers", "use_more_bits",
           "quantized_model_format", "checkpoint_source", "GateUp", "split_gate_up"]
