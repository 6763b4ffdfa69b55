"""Accuracy of each expert format as llama.cpp measures it (`llama-perplexity --kl-divergence`).

On held-out text (the validation documents of the corpus the shipped tiny models were trained on,
`models.corpus`, packed into fixed-length windows), each format's model is run teacher-forced beside the
bf16 model: perplexity of the next token, the KL divergence KL(bf16 || format) of the next-token
distributions (mean and 99th percentile over tokens) and the share of positions whose argmax token equals
the bf16 model's (greedy-token agreement). Only the routed experts change between the rows: dense weights
are the checkpoint's bf16 in every row.

    python -m models.quant.accuracy                      # both shipped tiny models, every format
    python -m models.quant.accuracy --models mixtral-tiny --formats q8_0 q4_k_m --windows 8
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from models.quant.experts import EXPERT_FORMATS

SHIPPED = {"mixtral-tiny": "pkg:models/checkpoints/mixtral-tiny", "deepseek-tiny": "pkg:models/checkpoints/deepseek-tiny"}


def held_out_windows(checkpoint: str, windows: int, length: int) -> np.ndarray:
    """int32 [windows, length]: the corpus's validation documents (sharegpt and stdlib docs), tokenized with the
    checkpoint's tokenizer, bos/eos around each, concatenated and cut into windows."""
    from core.config import resolve_path
    from models.corpus import CorpusConfig, CorpusSource, build_corpus
    from models.hf import read_config
    from models.loading import load_tokenizer

    folder = resolve_path(checkpoint)
    tok, cfg = load_tokenizer(folder), read_config(folder)
    corpus = build_corpus(CorpusConfig(sources=[CorpusSource.sharegpt, CorpusSource.stdlib_docs]))
    bos, eos = cfg.bos_token_id, cfg.eos_token_id
    stream: list[int] = []
    for text in corpus.texts("validation"):
        stream += [bos] + tok.encode(text).ids + [eos]
        if len(stream) >= windows * length:
            break
    if len(stream) < windows * length:
        raise ValueError(f"held-out text: {len(stream)} tokens, fewer than {windows} windows of {length}")
    return np.asarray(stream[:windows * length], np.int32).reshape(windows, length)


def log_probs(model: Any, tokens: np.ndarray, batch: int = 4, executor: Optional[Callable[[], Any]] = None
              ) -> np.ndarray:
    """float32 [W, S, V] log-softmax of the next-token logits, teacher-forced, `batch` windows per call. `executor`:
    a factory of a stateful expert executor for each call (run eagerly; e.g. Expert Deferral's); None: the jitted
    model."""
    import jax
    import jax.numpy as jnp

    from models.transformer import forward, forward_jit, init_cache

    out = []
    W, S = tokens.shape
    for i in range(0, W, batch):
        chunk = jnp.asarray(tokens[i:i + batch])
        cache = init_cache(model, chunk.shape[0], S, model.run_dtype)
        positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), chunk.shape)
        if executor is None:
            logits, _, _ = forward_jit(model, chunk, cache, positions)
        else:
            logits, _, _ = forward(model, chunk, cache, positions, executor=executor())
        out.append(np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)))
    return np.concatenate(out)


def compare(ref: np.ndarray, lp: np.ndarray, tokens: np.ndarray) -> dict[str, float]:
    """Perplexity of `lp` on the next tokens, KL(ref || lp) mean / p99 per position, argmax agreement with ref."""
    nxt = tokens[:, 1:]
    nll = -np.take_along_axis(lp[:, :-1], nxt[..., None], axis=-1)[..., 0]
    kl = np.sum(np.exp(ref) * (ref - lp), axis=-1)[:, :-1]
    same = np.argmax(ref, axis=-1) == np.argmax(lp, axis=-1)
    return {"ppl": float(np.exp(nll.mean())), "kl_mean": float(kl.mean()), "kl_p99": float(np.quantile(kl, 0.99)),
            "top1_agree": float(same[:, :-1].mean())}


def expert_bits(model: Any) -> Optional[float]:
    """Bits per routed-expert weight of a model (16 for bf16 experts)."""
    from models.quant.experts import QuantExperts

    cfg = model.cfg
    weights = 3 * cfg.hidden_size * cfg.expert_intermediate_size * cfg.num_experts * len(cfg.moe_layers)
    total = 0
    for layer in cfg.moe_layers:
        experts = model.layers[layer].moe.experts
        total += experts.nbytes if isinstance(experts, QuantExperts) else \
            weights // len(cfg.moe_layers) * np.dtype(experts.gate_up[0][...].dtype).itemsize
    return 8 * total / weights


def table(models: Sequence[str], formats: Sequence[str], windows: int, length: int) -> list[dict[str, Any]]:
    """One row per (model, format): the `compare` metrics against that model's bf16 run (or why it cannot run)."""
    from models.loading import load_model

    rows = []
    for name in models:
        ckpt = SHIPPED.get(name, name)
        tokens = held_out_windows(ckpt, windows, length)
        ref = None
        for fmt in ["bf16"] + [f for f in formats if f != "bf16"]:
            start = time.perf_counter()
            try:
                _, model, _ = load_model({"name": name, "checkpoint": ckpt, "expert_format": fmt}, dtype="auto")
            except ValueError as exc:
                rows.append({"model": name, "format": fmt, "error": str(exc)})
                continue
            lp = log_probs(model, tokens)
            ref = lp if ref is None else ref
            rows.append({"model": name, "format": fmt, "bits": expert_bits(model), **compare(ref, lp, tokens),
                         "tokens": int(tokens.size), "seconds": time.perf_counter() - start})
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    out = ["| model | experts | bits/weight | perplexity | mean KL | p99 KL | top-1 agreement |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | {r['format']} | n/a: {r['error'].split(': ', 1)[-1]} | | | | |")
        else:
            out.append(f"| {r['model']} | {r['format']} | {r['bits']:.2f} | {r['ppl']:.3f} | {r['kl_mean']:.5f} | "
                       f"{r['kl_p99']:.4f} | {100 * r['top1_agree']:.2f} % |")
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m models.quant.accuracy", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(SHIPPED))
    parser.add_argument("--formats", nargs="+", default=[f for f in EXPERT_FORMATS if f != "bf16"],
                        choices=EXPERT_FORMATS)
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)
    args = parser.parse_args(argv)
    rows = table(args.models, args.formats, args.windows, args.length)
    print(f"held-out text: {args.windows} windows of {args.length} tokens per model (corpus validation split)")
    print(markdown(rows))


if __name__ == "__main__":
    main()
