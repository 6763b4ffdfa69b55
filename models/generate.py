"""`python -m models.generate`: plain in-memory batched generation of a MoE model, tokens/s, results.json.

    python -m models.generate                                   # the embedded default model
    python -m models.generate model=bench_mixtral_29m batch_size=16
    python -m models.generate model.checkpoint=/path/to/hf_folder prompts='[Hello, "How are you"]'
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from conf import hydra_task
from conf.schemas.generate import GenerateConfig
from core.telemetry import Telemetry, scalars
import models.hf  # noqa: F401  (imported before the timed load, as the transformers peer's imports are)
from models.config import ModelConfig
from models.generation import GenerationOutput, Generator, SamplingParams
from models.loading import load_model, load_tokenizer, model_dtype, open_model_checkpoint
from models.memory import PeakMemory, memory_report


def make_prompts(cfg: GenerateConfig, model_cfg: ModelConfig, tokenizer: Any) -> list[list[int]]:
    """Token ids of the configured prompts, or `batch_size` seeded random prompts of `prompt_len` tokens."""
    if cfg.prompts:
        if tokenizer is None:
            raise ValueError("prompts: text prompts need a tokenizer (tokenizer.json in model.checkpoint)")
        return [tokenizer.encode(p).ids for p in cfg.prompts]
    if cfg.batch_size < 1:
        raise ValueError(f"batch_size: must be >= 1, got {cfg.batch_size}")
    rng = np.random.default_rng(cfg.seed)
    low = 3 if model_cfg.vocab_size > 3 else 0  # keep clear of the usual special ids
    return [rng.integers(low, model_cfg.vocab_size, cfg.prompt_len).tolist() for _ in range(cfg.batch_size)]


def run_generation(cfg: GenerateConfig, model_spec: Any) -> tuple[dict[str, Any], GenerationOutput, Any]:
    """Load the model, generate (after a warm-up that compiles), and return the results dict (with the
    load time and the peak anonymous memory against the checkpoint's bytes)."""
    with PeakMemory() as peak:
        t0 = time.perf_counter()
        opened = open_model_checkpoint(model_spec)
        dtype = model_dtype(cfg.dtype, opened)
        model_cfg, model, folder = load_model(model_spec, dtype=dtype, seed=cfg.seed, opened=opened)
        load_s = time.perf_counter() - t0
        results, out, tokenizer = generate_timed(cfg, model_cfg, model, folder)
    results.update({"model": model_spec.get("name"), "dtype": np.dtype(dtype).name, "load_s": load_s,
                    **memory_report(peak, opened.file_bytes if opened is not None else None)})
    return results, out, tokenizer


def generate_timed(cfg: GenerateConfig, model_cfg: ModelConfig, model: Any, folder: Any
                   ) -> tuple[dict[str, Any], GenerationOutput, Any]:
    """Generate the configured prompts twice (the first run compiles) and time the second."""
    tokenizer = load_tokenizer(folder)
    prompts = make_prompts(cfg, model_cfg, tokenizer)
    sampling = SamplingParams(cfg.sampling.temperature, cfg.sampling.top_p, cfg.sampling.seed)
    eos = model_cfg.eos_token_id if cfg.stop_at_eos else None
    gen = Generator(model)
    t0 = time.perf_counter()
    gen.generate(prompts, cfg.max_new_tokens, sampling, eos, model_cfg.pad_token_id)
    compile_s = time.perf_counter() - t0
    out = gen.generate(prompts, cfg.max_new_tokens, sampling, eos, model_cfg.pad_token_id)
    generated = int(out.lengths.sum())
    results: dict[str, Any] = {
        "family": model_cfg.family.value,
        "batch_size": len(prompts),
        "prompt_tokens": int(out.prompt_lengths.sum()),
        "generated_tokens": generated,
        "decode_tokens_per_s": out.decode_tokens / out.decode_s if out.decode_s > 0 else None,
        "end_to_end_tokens_per_s": generated / (out.prefill_s + out.decode_s),
        "prefill_s": out.prefill_s,
        "decode_s": out.decode_s,
        "decode_ms_per_step": 1e3 * out.decode_s / max(int(out.lengths.max()) - 1, 1),
        "compile_and_first_run_s": compile_s,
    }
    return results, out, tokenizer


@hydra_task("generate", metrics=scalars, hide=("generated_ids", "text"))
def main(node: DictConfig, tm: Telemetry) -> dict[str, Any]:
    cfg: GenerateConfig = OmegaConf.to_object(node)  # type: ignore[assignment]
    results, out, tokenizer = run_generation(cfg, node.model)
    samples = out.sequences()
    if tokenizer is not None:
        results["text"] = [tokenizer.decode(s) for s in samples]
    results["generated_ids"] = samples
    return results


if __name__ == "__main__":
    main()
