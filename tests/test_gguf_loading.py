"""`model.checkpoint=<file.gguf>` through models.loading (the hooks in models/loading.py): config from the metadata,
block experts installed, the file's tokenizer, `model.tokenizer` overriding it, dtype=auto the file's own."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from engine.bench.peers.to_gguf import convert
from models.gguf import open_gguf
from models.hf import CheckpointError, read_config
from tests.test_gguf import _gguf, _q8_folder, hf_folders  # noqa: F401  (the module-scoped fixture)


def test_model_checkpoint_names_a_gguf_file(hf_folders, tmp_path) -> None:
    """`model.checkpoint=<file.gguf>` through models.loading: config from the metadata, block experts installed,
    the tokenizer from the file, `model.tokenizer` overriding it (and refused where it does not fit)."""
    from models.loading import load_model, load_tokenizer, open_model_checkpoint, resolve_model_config
    from models.quant.experts import QuantExperts

    folder = _q8_folder(hf_folders)
    path = folder / "q8_0.gguf"
    if not path.is_file():
        convert(folder, path, dense="f32", experts="q8_0")
    spec = {"name": "tiny-gguf", "checkpoint": str(path)}
    cfg = resolve_model_config(spec)
    assert cfg == read_config(folder)
    assert open_model_checkpoint(spec).folder == path
    _, model, where = load_model(spec)
    assert where == path and isinstance(model.layers[cfg.moe_layers[0]].moe.experts, QuantExperts)
    assert load_tokenizer(path, spec).get_vocab_size() == cfg.vocab_size  # the converter's placeholder vocabulary
    shipped = "pkg:models/checkpoints/mixtral-tiny"  # a 4096-token tokenizer for a 97-token model
    with pytest.raises(CheckpointError, match="vocab_size"):
        load_tokenizer(path, {**spec, "tokenizer": shipped})
    with pytest.raises(ValueError, match="already in ggml blocks"):
        load_model({**spec, "expert_format": "q4_0"})


def test_auto_dtype_is_the_files_own(hf_folders) -> None:
    from models.loading import model_dtype

    assert model_dtype("auto", open_gguf(_gguf(hf_folders, "mixtral"))) == jnp.float32
    bf16 = hf_folders["mixtral"] / "bf16-q8.gguf"
    convert(_q8_folder(hf_folders), bf16, experts="q8_0")  # bf16 matrices, Q8_0 experts
    assert model_dtype("auto", open_gguf(bf16)) == jnp.bfloat16
