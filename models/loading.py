"""The `model` config group (`ModelSpec`, owned here) and its resolution into a `ModelConfig` (from its `arch`,
its checkpoint, or both), a checkpoint and a compute dtype."""

from __future__ import annotations

import dataclasses
import enum
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
from omegaconf import MISSING, DictConfig, OmegaConf

from core.config import resolve_path, store, to_frozen, unfrozen
from models.config import ModelConfig

class DType(enum.Enum):
    auto = "auto"  # the checkpoint's own dtype (bf16 for real MoE checkpoints); float32 for random weights
    float32 = "float32"
    bfloat16 = "bfloat16"


@dataclasses.dataclass
class ModelSpec:
    """A model: an architecture (`arch`), a checkpoint folder, or both (then they must agree).

    `checkpoint` is an HF folder (config.json + safetensors); `pkg:<path>` points inside the
    moescope tree (the shipped tiny models). Without a checkpoint the weights are random
    (seeded by the task's `seed`).
    """

    name: str = MISSING
    checkpoint: Optional[str] = None
    arch: Optional[unfrozen(ModelConfig)] = None  # type: ignore[valid-type]
    allow_nonfinite: bool = False  # serve a checkpoint with NaN / Inf weights (refused by default, naming the tensor)
    # the in-memory weights on 2 MiB pages: decode reads them a few per cent faster, loading can take several
    # times longer (models.memory.HostArrays)
    huge_pages: bool = False
    # routed experts' format (models.quant.experts.EXPERT_FORMATS): bf16 = as stored, in the run's dtype; q8_0, q4_0,
    # q4_k, q6_k = every expert tensor in that ggml block type, quantized on load; q4_k_m = llama.cpp's Q4_K_M preset.
    # A folder written by `python -m models.quant.save` is served in its own format (bf16 here means "as saved").
    expert_format: str = "bf16"
    # a GGUF file's dense projections (attention, LM head) stored in block types: `blocks` keeps them in their blocks
    # and multiplies by them with the native block kernels (each token reads the file's bytes, as llama.cpp does);
    # `dequantize` converts them to the run dtype on load (models.quant.dense)
    dense_format: str = "blocks"
    # an HF folder holding tokenizer.json (or the file itself) to use instead of the checkpoint's own
    # tokenizer (a GGUF file's metadata tokenizer, or the tokenizer.json beside an HF checkpoint); its ids must fit
    # the model's vocabulary
    tokenizer: Optional[str] = None


store(ModelSpec, name="base_model", group="model")


if TYPE_CHECKING:
    from models.hf import OpenCheckpoint
    from models.transformer import MoETransformer


def spec_node(spec: Any) -> DictConfig:
    """A `model` spec (a Hydra node, a `ModelSpec` or a plain dict) as the node every function here reads."""
    if isinstance(spec, DictConfig):
        return spec
    return OmegaConf.structured(spec) if dataclasses.is_dataclass(spec) else OmegaConf.create(dict(spec))


def resolve_model_config(spec: Any) -> ModelConfig:
    """The architecture of a `model` config node; a checkpoint's config.json must agree with `arch`."""
    node = spec_node(spec)
    arch, ckpt = node.get("arch"), node.get("checkpoint")
    from_arch = to_frozen(arch, ModelConfig) if arch is not None else None
    if ckpt is None:
        if from_arch is None:
            raise ValueError("model: set model.arch or model.checkpoint")
        return from_arch
    from models.gguf import is_gguf_path, read_gguf_config
    from models.hf import config_from_hf

    path = resolve_path(ckpt) / "config.json"
    if is_gguf_path(ckpt):  # a llama.cpp file: the config is its metadata
        path = resolve_path(ckpt)
        from_ckpt = read_gguf_config(path)
    elif not path.is_file():
        raise FileNotFoundError(f"model.checkpoint: {path} not found")
    else:
        from_ckpt = config_from_hf(json.loads(path.read_text()), where=str(path))
    if from_arch is not None and from_arch != from_ckpt:
        diff = [f for f in from_ckpt.__dataclass_fields__ if getattr(from_arch, f) != getattr(from_ckpt, f)]
        raise ValueError(f"model.arch disagrees with {path} on {diff}")
    return from_ckpt


def open_model_checkpoint(spec: Any) -> Optional["OpenCheckpoint"]:
    """The checkpoint a `model` config node names, opened and checked (headers only), or None (random weights)."""
    from models.hf import open_checkpoint

    from models.quant.checkpoint import open_dense, quantized_info

    ckpt = spec_node(spec).get("checkpoint")
    if ckpt is None:
        return None
    folder = resolve_path(ckpt)
    from models.fp8 import is_fp8_checkpoint, open_fp8
    from models.gguf import is_gguf_path, open_gguf

    if is_gguf_path(folder):  # a GGUF file / an FP8 folder: readers behind the same interface
        return open_gguf(folder)
    if is_fp8_checkpoint(folder):
        return open_fp8(folder)
    return open_dense(folder) if quantized_info(folder) else open_checkpoint(folder)


def check_weights(spec: Any, checkpoint: "OpenCheckpoint") -> None:
    """Refuse non-finite weights unless the `model` node sets `allow_nonfinite` (each checkpoint scanned once)."""
    if not spec_node(spec).get("allow_nonfinite", False):
        checkpoint.check_finite()


def model_dtype(choice: Any, checkpoint: Optional["OpenCheckpoint"]) -> Any:
    """The jnp dtype a run computes in: `auto` is the checkpoint's own (bf16 for every real MoE checkpoint,
    float32 for float32 or float16 files, which convert exactly), float32 for random weights."""
    import jax.numpy as jnp
    import ml_dtypes

    name = getattr(choice, "value", choice) or "auto"
    if name != "auto":
        return jnp.dtype(name)
    run_dtype = getattr(checkpoint.reader, "run_dtype", None) if checkpoint is not None else None
    if run_dtype is not None:  # a GGUF file says what its own dtype is (its experts stay in blocks)
        return jnp.dtype(run_dtype)
    if checkpoint is not None and checkpoint.stored_dtype() == ml_dtypes.bfloat16:
        return jnp.dtype(jnp.bfloat16)
    return jnp.dtype(jnp.float32)


def load_model(spec: Any, dtype: Any = None, seed: int = 0, with_experts: bool = True,
               opened: Optional["OpenCheckpoint"] = None) -> tuple[ModelConfig, "MoETransformer", Optional[Path]]:
    """The model a `model` config node names: its checkpoint (HF folder) or random weights of its `arch`.

    `dtype`: a jnp dtype or its name, `"auto"` (the checkpoint's own), None (float32). A checkpoint whose
    parameters would not fit in the host's available memory is an error before any weight is read.
    Returns (config, model, checkpoint folder or None).
    """
    from models.hf import load_hf
    from models.memory import check_fits
    from models.quant.checkpoint import mapped_experts, quantized_info
    from models.quant.experts import checkpoint_source, install, layer_formats, model_source, quantized_layers
    from models.transformer import build_model

    cfg = resolve_model_config(spec)
    fmt = expert_format(spec)
    formats = layer_formats(cfg, fmt)  # a format the experts' widths do not fit fails here, before any weight is read
    ck = opened or open_model_checkpoint(spec)
    dtype = model_dtype(dtype or "float32", ck) if dtype is None or isinstance(dtype, str) else dtype
    saved = quantized_info(ck.folder) if ck is not None else None
    from models.gguf import block_experts, has_block_experts

    blocks = ck is not None and has_block_experts(ck)  # a GGUF file's experts, served in their blocks
    if blocks and fmt != "bf16":
        raise ValueError(f"model.expert_format={fmt}: model.checkpoint {ck.folder} is a GGUF file whose experts are "
                         "already in ggml blocks (leave model.expert_format at bf16 to serve them as stored)")
    if ck is None:  # random weights: sized from the config before anything is allocated
        check_fits(model_bytes(cfg, dtype, with_experts), f"model={spec_node(spec).get('name', cfg.family.value)} "
                   f"(random weights, {np.dtype(dtype).name}" + (")" if with_experts else ", without its experts)"),
                   "pick a smaller model, or give the task a trace / checkpoint it can read without building this one")
        model = build_model(cfg, seed=seed, dtype=dtype, with_experts=with_experts)
        if formats and with_experts:
            install(model, quantized_layers(cfg, fmt, model_source(model)))
        return cfg, model, None
    quantized = bool(formats or saved or blocks)
    if saved and fmt not in ("bf16", saved.get("expert_format")):
        raise ValueError(f"model.expert_format={fmt}: model.checkpoint {ck.folder} holds {saved.get('expert_format')} "
                         "experts (leave model.expert_format at bf16 to serve them as saved)")
    what = f"model.checkpoint {ck.folder} in {np.dtype(dtype).name}" + ("" if with_experts else " without its experts")
    check_fits(ck.param_bytes(np.dtype(dtype), experts=with_experts and not quantized), what,
               "serve it offloaded (python -m engine.run ... compare_in_memory=false), whose experts stay in the "
               "checkpoint's mapped files")
    scan = not spec_node(spec).get("allow_nonfinite", False)  # each copy is scanned as it is written
    dense = dense_blocks(spec, ck)
    from models.quant.dense import param_path
    _, model = load_hf(ck.folder, dtype=dtype, with_experts=with_experts and not quantized, opened=ck,
                       check_finite=scan, huge_pages=bool(spec_node(spec).get("huge_pages", False)),
                       skip=frozenset(param_path(path) for path in dense))
    if dense:
        from models.quant.dense import install_dense

        install_dense(model, dense)
    if quantized and with_experts:
        if saved:
            install(model, mapped_experts(ck.folder, cfg))
        elif blocks:  # each layer's three stacked tensors as they are, else (older Mixtral files) per-expert views
            from models.gguf import block_expert_stacks
            from models.quant.experts import install_stacks

            stacks = block_expert_stacks(ck)
            if stacks is not None:
                install_stacks(model, stacks)
            else:
                install(model, block_experts(ck))
        else:
            if scan:
                ck.check_finite()
            install(model, quantized_layers(cfg, fmt, checkpoint_source(ck)))
    from models.memory import release_free_heap

    release_free_heap()  # the dequantizing / converting temporaries' freed heap pages
    return cfg, model, ck.folder


DENSE_FORMATS = ("blocks", "dequantize")


def dense_blocks(spec: Any, ck: "OpenCheckpoint") -> dict:
    """The dense projections `model.dense_format` keeps in their blocks: module path -> row parts (`QuantArray`s);
    empty for `dequantize` and for checkpoints that store no dense projection in a block type."""
    fmt = str(spec_node(spec).get("dense_format", None) or "blocks")
    if fmt not in DENSE_FORMATS:
        raise ValueError(f"model.dense_format={fmt!r} is not supported; supported: {', '.join(DENSE_FORMATS)}")
    if fmt == "dequantize":
        return {}
    from models.gguf import block_dense

    return block_dense(ck)


def model_bytes(cfg: ModelConfig, dtype: Any = np.float32, with_experts: bool = True) -> int:
    """Bytes of `cfg`'s parameters in `dtype`, counted on the abstract model (nothing allocated)."""
    import math

    import jax
    from flax import nnx

    from models.transformer import abstract_model

    state = nnx.state(abstract_model(cfg, with_experts=with_experts), nnx.Param)
    return np.dtype(dtype).itemsize * sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(state))


def quantized_experts(spec: Any, opened: Optional["OpenCheckpoint"] = None) -> bool:
    """Whether a `model` node's routed experts are served quantized (an `expert_format` or a saved quantized folder)."""
    from models.quant.checkpoint import quantized_info

    from models.gguf import has_block_experts

    return expert_format(spec) != "bf16" or (opened is not None and (quantized_info(opened.folder) is not None
                                                                     or has_block_experts(opened)))


def expert_format(spec: Any) -> str:
    """The `model.expert_format` of a model node (bf16 when unset), checked against the supported formats."""
    from models.quant.experts import check_format

    return check_format(str(spec_node(spec).get("expert_format", None) or "bf16"))


def load_tokenizer(folder: Optional[Path], spec: Any = None) -> Any:
    """The `tokenizers.Tokenizer` saved next to a checkpoint (tokenizer.json), or None. A GGUF file's
    own (from its metadata), or the `model.tokenizer` of `spec` when set, checked against the model's vocabulary."""
    from models.gguf import is_gguf_path

    override = spec_node(spec).get("tokenizer") if spec is not None else None
    if override is not None or (folder is not None and is_gguf_path(folder)):
        from models.gguf import read_gguf_config
        from models.gguf_tokenizer import load_tokenizer_for

        cfg = resolve_model_config(spec) if spec is not None else read_gguf_config(folder)
        return load_tokenizer_for(folder, None if override is None else resolve_path(override), cfg)
    if folder is None or not (Path(folder) / "tokenizer.json").is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
