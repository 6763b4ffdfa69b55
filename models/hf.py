"""HF checkpoints: config.json <-> `ModelConfig`, safetensors <-> the NNX model.

`load_hf(path)` reads a folder holding config.json and either `model.safetensors` or a sharded
`model.safetensors.index.json`, in the per-expert layout that `save_pretrained` writes
(`block_sparse_moe.experts.E.w1`, `mlp.experts.E.gate_proj`, ...) or the fused transformers-v5
layout (`mlp.experts.gate_up_proj` [E, 2F, H], `mlp.experts.down_proj` [E, H, F]). Every model
parameter has one `TensorSource` naming the HF tensors it is built from; a missing, unexpected or
mis-shaped tensor is an error that names it and the shape expected.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from core.telemetry import atomic_write_text
from models import deepseek, mixtral, olmoe, phimoe, qwen3_moe  # noqa: F401  (register the families)
from models.config import Family, ModelConfig, NormKind, QKNorm
from models.family import FAMILIES, FamilySpec
from models.memory import HostArrays, cpu_count
from models.native import count_nonfinite
from models.transformer import MoETransformer, abstract_model

SUPPORTED_MODEL_TYPES = {spec.model_type: spec for spec in FAMILIES.values()}
# Tensors some checkpoints carry that the model does not use.
_IGNORED = (re.compile(r".*rotary_emb\.inv_freq$"),)


class CheckpointError(ValueError):
    """A checkpoint whose files, config or tensors are not what the model needs."""


def family_spec(model_type: str, where: str = "config.json") -> FamilySpec:
    spec = SUPPORTED_MODEL_TYPES.get(model_type)
    if spec is None:
        raise CheckpointError(f"{where}: unknown model family model_type={model_type!r}; "
                              f"supported: {sorted(SUPPORTED_MODEL_TYPES)}")
    return spec


def config_from_hf(d: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """`ModelConfig` from the dict of an HF config.json (dispatch on `model_type`)."""
    spec = family_spec(str(d.get("model_type")), where)
    try:
        return spec.from_hf(d)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: {exc}") from None


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return FAMILIES[cfg.family].to_hf(cfg)


# ---- the tensor map ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    """One HF tensor (or the `index`-th slice of a fused [E, ...] tensor) with its full HF shape."""

    name: str
    shape: tuple[int, ...]
    index: Optional[int] = None

    @property
    def rows(self) -> int:
        """Rows this piece gives the parameter (its first axis after the fused slice)."""
        return self.shape[1] if self.index is not None else self.shape[0]

    @property
    def trailing(self) -> tuple[int, ...]:
        """Its axes after the first row axis."""
        return self.shape[2:] if self.index is not None else self.shape[1:]


@dataclass(frozen=True)
class TensorSource:
    """A model parameter (its path in the pure state dict) built from HF pieces stacked along the first
    axis: weights keep HF's [out, in] layout, so fused parameters (q|k|v, gate|up) are row blocks.
    `expert` is (decoder layer, expert) for routed experts."""

    path: tuple[Any, ...]
    pieces: tuple[Piece, ...]
    expert: Optional[tuple[int, int]] = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The parameter's shape: its pieces' rows stacked."""
        return (sum(p.rows for p in self.pieces),) + self.pieces[0].trailing


def _linear(path: tuple, name: str, d_in: int, d_out: int, bias: bool) -> list[TensorSource]:
    out = [TensorSource(path + ("weight",), (Piece(f"{name}.weight", (d_out, d_in)),))]
    if bias:
        out.append(TensorSource(path + ("bias",), (Piece(f"{name}.bias", (d_out,)),)))
    return out


def _norm(path: tuple, name: str, dim: int, with_bias: bool) -> list[TensorSource]:
    out = [TensorSource(path + ("weight",), (Piece(f"{name}.weight", (dim,)),))]
    if with_bias:
        out.append(TensorSource(path + ("bias",), (Piece(f"{name}.bias", (dim,)),)))
    return out


def _swiglu(path: tuple, name: str, hidden: int, inter: int) -> list[TensorSource]:
    return [TensorSource(path + ("gate_up",), (Piece(f"{name}.gate_proj.weight", (inter, hidden)),
                                               Piece(f"{name}.up_proj.weight", (inter, hidden)))),
            TensorSource(path + ("down",), (Piece(f"{name}.down_proj.weight", (hidden, inter)),))]


def _attention(cfg: ModelConfig, path: tuple, name: str) -> list[TensorSource]:
    H, b = cfg.hidden_size, cfg.attention_bias
    if cfg.uses_mla:
        nh = cfg.num_attention_heads
        q_out = nh * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        out: list[TensorSource] = []
        if cfg.q_lora_rank is None:
            out += _linear(path + ("q",), f"{name}.q_proj", H, q_out, False)
        else:
            out += _linear(path + ("q_a",), f"{name}.q_a_proj", H, cfg.q_lora_rank, b)
            out += _norm(path + ("q_a_norm",), f"{name}.q_a_layernorm", cfg.q_lora_rank, False)
            out += _linear(path + ("q_b",), f"{name}.q_b_proj", cfg.q_lora_rank, q_out, False)
        out += _linear(path + ("kv_a",), f"{name}.kv_a_proj_with_mqa", H, cfg.kv_lora_rank + cfg.qk_rope_head_dim, b)
        out += _norm(path + ("kv_a_norm",), f"{name}.kv_a_layernorm", cfg.kv_lora_rank, False)
        out += _linear(path + ("kv_b",), f"{name}.kv_b_proj", cfg.kv_lora_rank,
                       nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), False)
        out += _linear(path + ("o",), f"{name}.o_proj", nh * cfg.v_head_dim, H, b)
        return out
    d, nq, nkv = cfg.attn_head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    parts = (("q_proj", nq * d), ("k_proj", nkv * d), ("v_proj", nkv * d))
    out = [TensorSource(path + ("qkv", "weight"), tuple(Piece(f"{name}.{p}.weight", (n, H)) for p, n in parts))]
    if b:
        out.append(TensorSource(path + ("qkv", "bias"), tuple(Piece(f"{name}.{p}.bias", (n,)) for p, n in parts)))
    out += _linear(path + ("o",), f"{name}.o_proj", nq * d, H, b)
    if cfg.qk_norm is QKNorm.per_head:
        out += _norm(path + ("q_norm",), f"{name}.q_norm", d, False) + _norm(path + ("k_norm",), f"{name}.k_norm", d, False)
    elif cfg.qk_norm is QKNorm.full:
        out += _norm(path + ("q_norm",), f"{name}.q_norm", nq * d, False)
        out += _norm(path + ("k_norm",), f"{name}.k_norm", nkv * d, False)
    return out


def expert_pieces(cfg: ModelConfig, layer: int, expert: int, fused: bool) -> tuple[tuple[Piece, ...], Piece]:
    """The HF pieces of one routed expert of decoder layer `layer`: ((gate, up) or (gate|up,), down)."""
    spec = FAMILIES[cfg.family]
    H, F, E = cfg.hidden_size, cfg.expert_intermediate_size, cfg.num_experts
    prefix = f"model.layers.{layer}"
    if fused:
        experts = f"{prefix}.mlp.experts"
        return (Piece(f"{experts}.gate_up_proj", (E, 2 * F, H), expert),), Piece(f"{experts}.down_proj", (E, H, F), expert)
    names, base = spec.expert_names, f"{prefix}.{spec.legacy_moe_prefix}.experts.{expert}"
    return ((Piece(f"{base}.{names.gate}.weight", (F, H)), Piece(f"{base}.{names.up}.weight", (F, H))),
            Piece(f"{base}.{names.down}.weight", (H, F)))


def _moe(cfg: ModelConfig, spec: FamilySpec, layer: int, path: tuple, prefix: str, fused: bool) -> list[TensorSource]:
    H, F, E = cfg.hidden_size, cfg.expert_intermediate_size, cfg.num_experts
    moe = f"{prefix}.mlp" if fused else f"{prefix}.{spec.legacy_moe_prefix}"
    router = spec.fused_router if fused else spec.legacy_router
    out = [TensorSource(path + ("router", "weight"), (Piece(f"{moe}.{router}.weight", (E, H)),))]
    if cfg.family is Family.deepseek_v3:
        out.append(TensorSource(path + ("router", "bias"), (Piece(f"{moe}.{router}.e_score_correction_bias", (E,)),)))
    for e in range(E):
        gate_up, down = expert_pieces(cfg, layer, e, fused)
        out.append(TensorSource(path + ("experts", "gate_up", e), gate_up, expert=(layer, e)))
        out.append(TensorSource(path + ("experts", "down", e), (down,), expert=(layer, e)))
    if cfg.n_shared_experts:
        out += _swiglu(path + ("shared",), f"{moe}.shared_experts", H, F * cfg.n_shared_experts)
    return out


def tensor_sources(cfg: ModelConfig, fused: bool = False) -> list[TensorSource]:
    """Every parameter of `cfg`'s model with the HF tensors it comes from (per-expert or fused layout)."""
    spec = FAMILIES[cfg.family]
    H, V = cfg.hidden_size, cfg.vocab_size
    ln_bias = cfg.norm is NormKind.layernorm
    out = [TensorSource(("embed",), (Piece("model.embed_tokens.weight", (V, H)),))]
    for i in range(cfg.num_hidden_layers):
        path, prefix = ("layers", i), f"model.layers.{i}"
        out += _norm(path + ("input_norm",), f"{prefix}.input_layernorm", H, ln_bias)
        out += _attention(cfg, path + ("attn",), f"{prefix}.self_attn")
        out += _norm(path + ("post_norm",), f"{prefix}.post_attention_layernorm", H, ln_bias)
        if cfg.is_moe_layer(i):
            out += _moe(cfg, spec, i, path + ("moe",), prefix, fused)
        else:
            out += _swiglu(path + ("mlp",), f"{prefix}.mlp", H, cfg.intermediate_size)
    out += _norm(("norm",), "model.norm", H, ln_bias)
    if not cfg.tie_word_embeddings:
        out += _linear(("lm_head",), "lm_head", H, V, cfg.lm_head_bias)
    return out


# ---- reading ------------------------------------------------------------------------------------

# safetensors dtypes a model can run from (converted on load when the run's dtype differs); anything
# else (FP8, integer-quantized weights) needs dequantizing before moescope can serve it
_SAFETENSORS_DTYPES = {"F32": np.dtype(np.float32), "BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16),
                       "F64": np.dtype(np.float64)}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies: its shard, safetensors dtype name, shape and byte range in the file."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def read_safetensors_header(path: Path) -> tuple[dict[str, TensorEntry], int]:
    """The tensors of one safetensors file (name -> entry with absolute byte offsets) and the file size."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or 8 + n > size:
                raise ValueError(f"header length {n} does not fit a {size}-byte file")
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable safetensors file ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: unreadable safetensors file (header is not a JSON object)")
    out: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, stop = (int(v) for v in info["data_offsets"])
            entry = TensorEntry(path.name, str(info["dtype"]), tuple(int(d) for d in info["shape"]), 8 + n + begin, 8 + n + stop)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry ({exc})") from None
        if entry.end > size or entry.end < entry.start:
            raise CheckpointError(f"{path}: tensor {name!r} lies past the end of the file (truncated: {size} bytes, "
                                  f"needs {entry.end})")
        out[name] = entry
    return out, size


class CheckpointReader:
    """The tensors of a single-file or sharded safetensors checkpoint as zero-copy views of its files.

    Each shard is memory-mapped read-only once; `view` returns a numpy array over the mapped bytes
    (file-backed pages: reading a 100 GB checkpoint allocates no anonymous memory). Headers are read and
    checked at construction, before any tensor data is touched.
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        single = self.folder / "model.safetensors"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index}: not a safetensors index ({exc})") from None
            files = sorted(set(weight_map.values()))
        elif single.is_file():
            files, weight_map = [single.name], None
        else:
            raise CheckpointError(f"{self.folder}: neither model.safetensors nor model.safetensors.index.json")
        self._entries: dict[str, TensorEntry] = {}
        self.file_bytes = 0
        for fname in files:
            path = self.folder / fname
            if not path.is_file():
                raise CheckpointError(f"{path}: shard named in the index is missing")
            entries, size = read_safetensors_header(path)
            self._entries.update(entries)
            self.file_bytes += size
        if weight_map is not None:
            for key, fname in weight_map.items():
                if key not in self._entries:
                    raise CheckpointError(f"{self.folder / fname}: tensor {key!r} listed in the index is absent")
        self._maps: dict[str, np.memmap] = {}

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name].shape

    def dtype(self, name: str) -> np.dtype:
        """The numpy dtype a tensor is stored in; a CheckpointError for dtypes moescope cannot compute with."""
        entry = self._entries[name]
        if entry.dtype not in _SAFETENSORS_DTYPES:
            raise CheckpointError(f"{self.folder / entry.file}: tensor {name} is stored as {entry.dtype}; moescope runs "
                                  f"checkpoints stored as {sorted(_SAFETENSORS_DTYPES)} (dequantize it first)")
        return _SAFETENSORS_DTYPES[entry.dtype]

    def _map(self, fname: str) -> np.memmap:
        if fname not in self._maps:
            self._maps[fname] = np.memmap(self.folder / fname, dtype=np.uint8, mode="r")
        return self._maps[fname]

    def view(self, piece: Piece) -> np.ndarray:
        """The piece as a read-only numpy view of the mapped file, in its stored dtype."""
        entry = self._entries[piece.name]
        dtype = self.dtype(piece.name)
        arr = self._map(entry.file)[entry.start:entry.end].view(dtype).reshape(entry.shape)
        return arr if piece.index is None else arr[piece.index]


def detect_fused(names: Iterable[str]) -> bool:
    """True for the transformers-v5 fused expert layout."""
    return any(n.endswith("experts.gate_up_proj") for n in names)


def validate_checkpoint(reader: CheckpointReader, sources: list[TensorSource], cfg: ModelConfig) -> None:
    """Raise CheckpointError naming every missing / unexpected / mis-shaped / non-float tensor (first few of each)."""
    expected: dict[str, tuple[int, ...]] = {}
    for src in sources:
        for piece in src.pieces:
            expected[piece.name] = piece.shape
    present = set(reader.keys())
    problems: list[str] = []
    missing = [n for n in expected if n not in present]
    if missing:
        problems += [f"missing tensor {n} (expected shape {list(expected[n])})" for n in missing[:8]]
        if len(missing) > 8:
            problems.append(f"... and {len(missing) - 8} more missing")
    extra = [n for n in sorted(present - set(expected)) if not _ignorable(n, cfg)]
    if extra:
        problems += [f"unexpected tensor {n} (shape {list(reader.shape(n))})" for n in extra[:8]]
        if len(extra) > 8:
            problems.append(f"... and {len(extra) - 8} more unexpected")
    for name, shape in expected.items():
        if name in present and reader.shape(name) != shape:
            problems.append(f"tensor {name} has shape {list(reader.shape(name))}, expected {list(shape)}")
    if problems:
        raise CheckpointError(f"{reader.folder}: checkpoint does not match its config.json:\n  " + "\n  ".join(problems))
    for name in expected:
        reader.dtype(name)  # a quantized tensor is an error before any data is read


def _ignorable(name: str, cfg: ModelConfig) -> bool:
    if any(p.match(name) for p in _IGNORED):
        return True
    m = re.match(r"model\.layers\.(\d+)\.", name)
    # DeepSeek-V3 multi-token-prediction layers sit after the last decoder layer; inference ignores them.
    return bool(m) and cfg.family is Family.deepseek_v3 and int(m.group(1)) >= cfg.num_hidden_layers


def refuse_nonfinite(folder: Path, name: str, values: np.ndarray) -> None:
    """A CheckpointError naming tensor `name` of the checkpoint in `folder` if `values` hold NaN or Inf."""
    bad = count_nonfinite(values)
    if bad:
        raise CheckpointError(f"{folder}: tensor {name} has {bad} NaN/Inf values (model.allow_nonfinite=true "
                              "serves it anyway)")


def assemble(reader: CheckpointReader, src: TensorSource, dtype: Any, arrays: Optional[HostArrays] = None
             ) -> np.ndarray:
    """The parameter `src` describes, as a fresh 64-byte-aligned numpy array of `dtype` from `arrays` (pieces
    stacked along the first axis, converted from the stored dtype where it differs)."""
    parts = [reader.view(p) for p in src.pieces]
    out = (arrays or HostArrays()).empty(src.shape, dtype)
    row = 0
    for part in parts:
        dst = out[row:row + part.shape[0]]
        if part.dtype == dst.dtype and part.dtype.itemsize == 2:  # as raw bytes: numpy drops the GIL for those
            np.copyto(dst.view(np.uint16), part.view(np.uint16))
        else:
            dst[...] = part
        row += part.shape[0]
    return out


def to_device(arr: Any) -> Any:
    """A host array (or a list of them, in one call) as a device array. On the CPU backend the jax array
    aliases an aligned `arr` (no second copy, and the pages `HostArrays` chose, not XLA's own buffers); on an
    accelerator it is a transfer."""
    return jax.device_put(arr, may_alias=True)


def read_config(folder: str | Path) -> ModelConfig:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: not found")
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: invalid JSON ({exc})") from None
    return config_from_hf(d, where=str(path))


def _set_path(tree: dict, path: tuple, value: Any) -> None:
    node = tree
    for key in path[:-1]:
        node = node[key]
    if path[-1] not in node:
        raise KeyError(f"model has no parameter {'.'.join(map(str, path))}")
    node[path[-1]] = value


@dataclass
class OpenCheckpoint:
    """A checkpoint folder opened and checked: its config, reader and tensor map (nothing read yet)."""

    folder: Path
    cfg: ModelConfig
    reader: CheckpointReader
    sources: list[TensorSource]
    fused: bool
    finite: bool = False  # every parameter scanned by `check_finite` and found finite

    @property
    def file_bytes(self) -> int:
        return self.reader.file_bytes

    def stored_dtype(self) -> np.dtype:
        """The dtype the routed experts are stored in (the checkpoint's own dtype)."""
        src = next((s for s in self.sources if s.expert is not None), self.sources[0])
        return self.reader.dtype(src.pieces[0].name)

    def check_finite(self) -> None:
        """A CheckpointError naming the first tensor with NaN or Inf values (a checkpoint damaged in conversion or
        training serves garbage tokens otherwise). Reads every parameter byte once, at memory speed; a second call
        (the in-memory model and the expert store of one run) reads nothing."""
        if self.finite:
            return
        names = dict.fromkeys(p.name for s in self.sources for p in s.pieces)
        for name in names:
            refuse_nonfinite(self.folder, name, self.reader.view(Piece(name, self.reader.shape(name))))
        self.finite = True

    def param_bytes(self, dtype: Any, experts: bool = True) -> int:
        """Bytes of the model's parameters in `dtype` (routed experts left out unless `experts`)."""
        size = np.dtype(dtype).itemsize
        return sum(size * int(np.prod(p.shape[1:] if p.index is not None else p.shape))
                   for s in self.sources if experts or s.expert is None for p in s.pieces)


def open_checkpoint(folder: str | Path) -> OpenCheckpoint:
    """Read config.json and every shard header, and check tensor names, shapes and dtypes against the config."""
    cfg = read_config(folder)
    reader = CheckpointReader(folder)
    fused = detect_fused(reader.keys())
    sources = tensor_sources(cfg, fused=fused)
    validate_checkpoint(reader, sources, cfg)
    return OpenCheckpoint(Path(folder), cfg, reader, sources, fused)


def load_hf(folder: str | Path, dtype: Any = jnp.float32, with_experts: bool = True,
            opened: Optional[OpenCheckpoint] = None, check_finite: bool = False,
            huge_pages: bool = False, skip: frozenset = frozenset()) -> tuple[ModelConfig, MoETransformer]:
    """Load an HF MoE checkpoint folder into an NNX model (routed experts skipped when `with_experts` is False,
    e.g. for the offload executor, which reads them from the files itself).

    Each parameter is copied once from the memory-mapped files into its own aligned host array (converted to
    `dtype` on the way when the checkpoint stores another), which the device array aliases on the CPU
    backend: the model's own arrays are the only lasting allocation. `check_finite` refuses NaN / Inf
    weights (a CheckpointError naming the tensor), scanning each copy right after it is written, while it
    is still in cache, instead of reading the files a second time. `huge_pages`: those host arrays on 2 MiB pages
    (see `models.memory.HostArrays`). `skip`: parameter paths the caller fills itself (left abstract here, e.g. dense
    projections kept in a GGUF file's blocks, `models.quant.dense.install_dense`).
    """
    ck = opened or open_checkpoint(folder)
    dtype = jnp.dtype(dtype)
    np_dtype = np.dtype(dtype)
    check_finite = check_finite and not ck.finite
    graphdef, state = nnx.split(abstract_model(ck.cfg, dtype, with_experts=with_experts))
    pure = nnx.to_pure_dict(state)
    wanted = [src for src in ck.sources if (with_experts or src.expert is None) and src.path not in skip]
    shapes = [(src.shape, np_dtype) for src in wanted]
    arrays = HostArrays(huge_pages, capacity=HostArrays.footprint(shapes, huge_pages))

    def read(src: TensorSource) -> np.ndarray:
        host = assemble(ck.reader, src, np_dtype, arrays)
        if check_finite and count_nonfinite(host):
            for piece in src.pieces:  # name the stored tensor that holds them
                refuse_nonfinite(ck.folder, piece.name, ck.reader.view(piece))
        return host

    # two readers: page population, copies and scans all run without the GIL, so one thread's system calls
    # overlap the other's copying
    with ThreadPoolExecutor(max(1, min(2, cpu_count()))) as pool:
        hosts = list(pool.map(read, wanted))
    for src, arr in zip(wanted, to_device(hosts)):
        _set_path(pure, src.path, arr)
    skipped = {"".join(f"[{key!r}]" for key in path) for path in skip}
    unfilled = [jax.tree_util.keystr(p) for p, leaf in jax.tree_util.tree_leaves_with_path(pure)
                if isinstance(leaf, jax.ShapeDtypeStruct) and jax.tree_util.keystr(p) not in skipped]
    if unfilled:
        raise CheckpointError(f"{folder}: no tensor for model parameters {unfilled[:8]}")
    ck.finite = ck.finite or (check_finite and with_experts)
    nnx.replace_by_pure_dict(state, pure)
    return ck.cfg, nnx.merge(graphdef, state)


# ---- writing ----------------------------------------------------------------------------------------


def state_to_hf_tensors(cfg: ModelConfig, model: MoETransformer, fused: bool = False, dtype: Any = None
                        ) -> dict[str, np.ndarray]:
    """The model's parameters as HF-named numpy arrays (per-expert layout unless `fused`)."""
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    out: dict[str, np.ndarray] = {}
    fused_parts: dict[str, dict[int, np.ndarray]] = {}
    for src in tensor_sources(cfg, fused=fused):
        node: Any = pure
        for key in src.path:
            node = node[key]
        arr = np.asarray(jax.device_get(node))
        if dtype is not None:
            arr = arr.astype(dtype)
        chunks = np.split(arr, np.cumsum([p.rows for p in src.pieces])[:-1], axis=0) if len(src.pieces) > 1 else [arr]
        for piece, chunk in zip(src.pieces, chunks):
            chunk = np.ascontiguousarray(chunk)
            if piece.index is None:
                out[piece.name] = chunk
            else:
                fused_parts.setdefault(piece.name, {})[piece.index] = chunk
    for name, parts in fused_parts.items():
        out[name] = np.stack([parts[e] for e in sorted(parts)])
    return out


def save_hf(cfg: ModelConfig, model: MoETransformer, folder: str | Path, fused: bool = False,
            dtype: Any = None, extra_config: Optional[dict[str, Any]] = None) -> Path:
    """Write config.json + model.safetensors loadable by `load_hf` and by transformers."""
    import torch  # torch: only writing a checkpoint needs it (reading maps the files with numpy)
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, arr in state_to_hf_tensors(cfg, model, fused=fused, dtype=dtype).items():
        if arr.dtype == ml_dtypes.bfloat16:
            tensors[name] = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
        else:
            tensors[name] = torch.from_numpy(np.array(arr, copy=True))
    tmp = folder / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(folder / "model.safetensors")
    hf_cfg = config_to_hf(cfg)
    hf_cfg["dtype"] = "bfloat16" if dtype is ml_dtypes.bfloat16 else "float32"
    hf_cfg.update(extra_config or {})
    atomic_write_text(folder / "config.json", json.dumps(hf_cfg, indent=2) + "\n")
    return folder
