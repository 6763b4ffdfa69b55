"""`python -m models.train` end to end on a small budget: loss falls, orbax resume, HF export."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from models.hf import load_hf
from models.train import EpochBatches
from tests.test_generate_entry import run_entry

SMALL = ["model=tiny_mixtral", "corpus.sources=[sharegpt]", "batch_size=4", "seq_len=32", "eval_every=4",
         "checkpoint_every=4", "log_every=2", "eval_batches=2", "optim.warmup_steps=2", "wandb.mode=disabled"]


def test_train_resume_and_export(tmp_path: Path) -> None:
    first = run_entry("models.train", f"hydra.run.dir={tmp_path / 'a'}", "steps=8", "max_minutes=10", *SMALL)
    assert first.returncode == 0, first.stderr[-3000:]
    a = json.loads((tmp_path / "a" / "results.json").read_text())
    assert a["steps"] == 8 and a["history"][-1]["val_ce"] < a["history"][0]["val_ce"] + 1e-6
    assert a["final_val_ce"] < np.log(512)  # better than uniform over the vocabulary

    # continue the same run to 12 steps from its step-8 checkpoint
    second = run_entry("models.train", f"hydra.run.dir={tmp_path / 'b'}", "steps=12", f"resume={tmp_path / 'a'}", *SMALL)
    assert second.returncode == 0, second.stderr[-3000:]
    b = json.loads((tmp_path / "b" / "results.json").read_text())
    assert b["resumed_from_step"] == 8 and b["steps"] == 12

    # a damaged latest step is skipped by the same `models.checkpointing.restore_latest` that predictors.train
    # resumes through; tests/test_predictors_train.py damages a step and checks the skip and its one-line warning

    export = Path(b["export_dir"])
    cfg, model = load_hf(export)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(export)
    ids = tok("Write a haiku about experts.")["input_ids"]
    assert tok.decode(ids) == "Write a haiku about experts."
    import jax.numpy as jnp

    from models.transformer import forward_jit, init_cache

    ours, _, _ = forward_jit(model, jnp.asarray([ids]), init_cache(model, 1, len(ids)), jnp.arange(len(ids))[None])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-3)


def test_epoch_batches_are_a_function_of_the_step() -> None:
    seqs = np.arange(40).reshape(10, 4)
    batches = EpochBatches(seqs, batch_size=3, seed=5)
    epoch0 = np.concatenate([batches(s) for s in range(3)])
    assert len(set(epoch0[:, 0].tolist())) == 9  # no repeats inside an epoch
    np.testing.assert_array_equal(batches(4), EpochBatches(seqs, 3, 5)(4))
    assert not np.array_equal(batches(0), batches(3))  # the next epoch is reshuffled
