"""`python -m models.train`: pre-train a tiny MoE language model on offline text and export it.

    python -m models.train                                  # the shipped tiny Mixtral recipe
    python -m models.train model=train_deepseek_tiny        # the shipped tiny DeepSeek-V2 recipe
    python -m models.train resume=runs/train/<run>          # continue an interrupted run

Text: `models.corpus` (ShareGPT prompts + Python standard-library docs and source). Tokenizer: a
byte-level BPE trained on the training split (or `tokenizer=<folder>`). Documents are wrapped in
BOS/EOS, concatenated and cut into sequences of seq_len + 1 tokens; every epoch visits them in a
seeded permutation, so the batch of any step is a pure function of (seed, step) and a resumed
run sees exactly the data it would have seen. Optimiser: AdamW, linear warmup then cosine decay.
Checkpoints: orbax (params, optimiser state, step) every `checkpoint_every` steps; a resume skips a
damaged latest step for the newest intact one (`models.checkpointing`). Export: HF
safetensors + config.json + tokenizer, loadable by `models.load_hf` and by transformers.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from omegaconf import DictConfig, OmegaConf

from core.config import resolve_path
from conf import hydra_task
from conf.schemas.train import TrainConfig
from core.telemetry import Telemetry, atomic_write_text, results_text
from models.checkpointing import checkpoint_manager, restore_latest, run_checkpoints
from models.config import ModelConfig
from models.corpus import Corpus, CorpusConfig, CorpusSource, build_corpus
from models.hf import save_hf
from models.loading import load_tokenizer, model_bytes, resolve_model_config
from models.memory import check_fits
from models.tokenizer import save_hf_tokenizer, special_token_ids, train_bpe
from models.training import LossConfig, lm_schedule, make_eval_step, make_optimizer, make_train_step
from models.transformer import build_model


# ---- data ---------------------------------------------------------------------------------------


def encode_stream(tokenizer: Any, texts: Iterable[str], bos: int, eos: int) -> np.ndarray:
    """int32 [N]: every text as BOS + ids + EOS, concatenated."""
    pieces = [np.asarray([bos] + enc.ids + [eos], np.int32) for enc in tokenizer.encode_batch(list(texts))]
    return np.concatenate(pieces) if pieces else np.zeros(0, np.int32)


def pack(stream: np.ndarray, seq_len: int, where: str) -> np.ndarray:
    """int32 [n, seq_len + 1]: non-overlapping windows of the stream (the tail shorter than one is dropped)."""
    n = len(stream) // (seq_len + 1)
    if n == 0:
        raise ValueError(f"{where}: {len(stream)} tokens do not fill one sequence of seq_len+1={seq_len + 1}")
    return stream[: n * (seq_len + 1)].reshape(n, seq_len + 1)


class EpochBatches:
    """Batch `step` of a seeded sequence of epoch permutations over `sequences`."""

    def __init__(self, sequences: np.ndarray, batch_size: int, seed: int):
        if batch_size > len(sequences):
            raise ValueError(f"batch_size: {batch_size} exceeds the {len(sequences)} training sequences")
        self.sequences, self.batch_size, self.seed = sequences, batch_size, seed
        self.per_epoch = len(sequences) // batch_size

    def __call__(self, step: int) -> np.ndarray:
        epoch, i = divmod(step, self.per_epoch)
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.sequences))
        return self.sequences[order[i * self.batch_size:(i + 1) * self.batch_size]]


def training_texts(corpus: Corpus, repeat: dict[str, int]) -> list[str]:
    """Train-split texts, documents of a source repeated `repeat[source]` times (upsampling)."""
    unknown = set(repeat) - {s.value for s in CorpusSource}
    if unknown:
        raise ValueError(f"corpus.repeat: unknown sources {sorted(unknown)}")
    return [d.text for d in corpus.train for _ in range(max(1, int(repeat.get(d.source.value, 1))))]


# ---- the run --------------------------------------------------------------------------------------


def prepare_tokenizer(cfg: TrainConfig, model_cfg: ModelConfig, corpus: Corpus) -> Any:
    if cfg.tokenizer is not None:
        tok = load_tokenizer(resolve_path(cfg.tokenizer))
        if tok is None:
            raise FileNotFoundError(f"tokenizer: no tokenizer.json in {cfg.tokenizer}")
    else:
        tok = train_bpe(corpus.texts("train"), vocab_size=model_cfg.vocab_size)
    if tok.get_vocab_size() > model_cfg.vocab_size:
        raise ValueError(f"tokenizer: {tok.get_vocab_size()} tokens exceed model.arch.vocab_size={model_cfg.vocab_size}")
    return tok


def export(model_cfg: ModelConfig, model: Any, tokenizer: Any, folder: Path, dtype: str) -> Path:
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    save_hf(model_cfg, model, folder, dtype=np_dtype)
    save_hf_tokenizer(tokenizer, folder, model_max_length=model_cfg.max_position_embeddings)
    return folder


def train(cfg: TrainConfig, tm: Telemetry) -> dict[str, Any]:
    started = time.perf_counter()
    model_cfg = resolve_model_config(cfg.model)
    # float32 parameters, their gradients and AdamW's two moments: four copies, sized before any is allocated
    check_fits(4 * model_bytes(model_cfg, np.float32), f"training model={cfg.model.name} (parameters, gradients and "
               "AdamW moments in float32)", "train a smaller model")
    corpus = build_corpus(CorpusConfig(sources=list(cfg.corpus.sources),
                                       validation_fraction=cfg.corpus.validation_fraction,
                                       max_chars=cfg.corpus.max_chars))
    tokenizer = prepare_tokenizer(cfg, model_cfg, corpus)
    ids = special_token_ids(tokenizer)
    bos, eos = ids["bos_token_id"], ids["eos_token_id"]
    train_seqs = pack(encode_stream(tokenizer, training_texts(corpus, dict(cfg.corpus.repeat)), bos, eos),
                      cfg.seq_len, "corpus train split")
    val_seqs = pack(encode_stream(tokenizer, corpus.texts("validation"), bos, eos),
                    cfg.seq_len, "corpus validation split")
    batches = EpochBatches(train_seqs, cfg.batch_size, cfg.seed)
    val_batches = [val_seqs[i:i + cfg.batch_size] for i in range(0, len(val_seqs), cfg.batch_size)]
    val_batches = [b for b in val_batches if len(b) == cfg.batch_size][: cfg.eval_batches] or [val_seqs[:cfg.batch_size]]

    model = build_model(model_cfg, seed=cfg.seed)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    o = cfg.optim
    tx = make_optimizer(lm_schedule(o.lr, o.warmup_steps, cfg.steps, o.min_lr_ratio), o.weight_decay, o.clip_norm, b2=0.95)
    opt_state = tx.init(params)
    start_step = 0
    if cfg.resume is not None:
        start_step, restored = restore_latest(run_checkpoints(resolve_path(cfg.resume)),
                                              {"params": params, "opt_state": opt_state})
        params, opt_state = restored["params"], restored["opt_state"]
    loss_cfg = LossConfig(aux_loss_coef=cfg.aux_loss_coef, capacity_factor=cfg.capacity_factor)
    train_step, eval_step = make_train_step(loss_cfg), make_eval_step(loss_cfg)
    mngr = checkpoint_manager(tm.run_dir / "checkpoints", cfg.keep_checkpoints)

    def evaluate() -> float:
        losses = [float(eval_step(graphdef, params, rest, jnp.asarray(b))["ce"]) for b in val_batches]
        return float(np.mean(losses))

    history: list[dict[str, float]] = []
    step, last_train_ce, tokens_per_step = start_step, math.nan, cfg.batch_size * cfg.seq_len
    window_start, window_steps = time.perf_counter(), 0
    deadline = None if cfg.max_minutes is None else started + 60.0 * cfg.max_minutes
    for step in tm.progress(range(start_step, cfg.steps), "train"):
        params, opt_state, metrics = train_step(graphdef, params, rest, opt_state, jnp.asarray(batches(step)), tx)
        window_steps += 1
        done = step + 1
        if done % cfg.log_every == 0 or done == cfg.steps:
            m = {k: float(v) for k, v in metrics.items()}
            last_train_ce = m["ce"]
            m["tokens_per_s"] = window_steps * tokens_per_step / (time.perf_counter() - window_start)
            window_start, window_steps = time.perf_counter(), 0
            tm.log({f"train/{k}": v for k, v in m.items()}, step=done)
        if done % cfg.eval_every == 0 or done == cfg.steps:
            val = evaluate()
            history.append({"step": done, "train_ce": last_train_ce, "val_ce": val})
            tm.log({"val/ce": val}, step=done)
        if done % cfg.checkpoint_every == 0 or done == cfg.steps:
            mngr.save(done, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
        if deadline is not None and time.perf_counter() > deadline:
            mngr.save(done, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}), force=True)
            break
    mngr.wait_until_finished()
    steps_done = step + 1 if cfg.steps > start_step else start_step
    final_val = evaluate()
    trained = nnx.merge(graphdef, params, rest)
    export_dir = resolve_path(cfg.export_dir) if cfg.export_dir else tm.run_dir / "export"
    export(model_cfg, trained, tokenizer, export_dir, cfg.export_dtype.value)
    return {
        "model": cfg.model.name, "family": model_cfg.family.value,
        "parameters": int(sum(x.size for x in jax.tree_util.tree_leaves(params))),
        "steps": steps_done, "resumed_from_step": start_step, "tokens_seen": steps_done * tokens_per_step,
        "train_sequences": len(train_seqs), "validation_sequences": len(val_seqs),
        "final_train_ce": last_train_ce, "final_val_ce": final_val, "history": history,
        "train_minutes": (time.perf_counter() - started) / 60.0, "export_dir": str(export_dir),
        "export_bytes": int(sum(f.stat().st_size for f in export_dir.iterdir() if f.is_file())),
        "corpus": corpus.stats(),
    }


@hydra_task("train", hide=("history", "corpus"))
def main(node: DictConfig, tm: Telemetry) -> dict[str, Any]:
    cfg: TrainConfig = OmegaConf.to_object(node)  # type: ignore[assignment]
    results = train(cfg, tm)
    atomic_write_text(Path(results["export_dir"]) / "training.json", results_text(results))  # beside the export
    return results


if __name__ == "__main__":
    main()
