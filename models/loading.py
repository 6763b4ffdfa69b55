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
    from models.hf import config_from_hf

    path = resolve_path(ckpt) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model.checkpoint: {path} not found")
    from_ckpt = config_from_hf(json.loads(path.read_text()), where=str(path))
    if from_arch is not None and from_arch != from_ckpt:
        diff = [f for f in from_ckpt.__dataclass_fields__ if getattr(from_arch, f) != getattr(from_ckpt, f)]
        raise ValueError(f"model.arch disagrees with {path} on {diff}")
    return from_ckpt


def open_model_checkpoint(spec: Any) -> Optional["OpenCheckpoint"]:
    """The checkpoint a `model` config node names, opened and checked (headers only), or None (random weights)."""
    from models.hf import open_checkpoint

    ckpt = spec_node(spec).get("checkpoint")
    return None if ckpt is None else open_checkpoint(resolve_path(ckpt))


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
    from models.transformer import build_model

    cfg = resolve_model_config(spec)
    ck = opened or open_model_checkpoint(spec)
    dtype = model_dtype(dtype or "float32", ck) if dtype is None or isinstance(dtype, str) else dtype
    if ck is None:  # random weights: sized from the config before anything is allocated
        check_fits(model_bytes(cfg, dtype, with_experts), f"model={spec_node(spec).get('name', cfg.family.value)} "
                   f"(random weights, {np.dtype(dtype).name}" + (")" if with_experts else ", without its experts)"),
                   "pick a smaller model, or give the task a trace / checkpoint it can read without building this one")
        return cfg, build_model(cfg, seed=seed, dtype=dtype, with_experts=with_experts), None
    what = f"model.checkpoint {ck.folder} in {np.dtype(dtype).name}" + ("" if with_experts else " without its experts")
    check_fits(ck.param_bytes(np.dtype(dtype), experts=with_experts), what,
               "serve it offloaded (python -m engine.run ... compare_in_memory=false), whose experts stay in the "
               "checkpoint's mapped files")
    scan = not spec_node(spec).get("allow_nonfinite", False)  # each copy is scanned as it is written
    _, model = load_hf(ck.folder, dtype=dtype, with_experts=with_experts, opened=ck, check_finite=scan,
                       huge_pages=bool(spec_node(spec).get("huge_pages", False)))
    return cfg, model, ck.folder


def model_bytes(cfg: ModelConfig, dtype: Any = np.float32, with_experts: bool = True) -> int:
    """Bytes of `cfg`'s parameters in `dtype`, counted on the abstract model (nothing allocated)."""
    import math

    import jax
    from flax import nnx

    from models.transformer import abstract_model

    state = nnx.state(abstract_model(cfg, with_experts=with_experts), nnx.Param)
    return np.dtype(dtype).itemsize * sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(state))


def load_tokenizer(folder: Optional[Path]) -> Any:
    """The `tokenizers.Tokenizer` saved next to a checkpoint (tokenizer.json), or None."""
    if folder is None or not (Path(folder) / "tokenizer.json").is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
