"""Where a whole-model prefill's time goes: the jitted prefill, then its parts as their own jitted programs.

    python -m engine.bench.bench_prefill_breakdown /tmp/gg/mix1-q4_k_m.gguf --prompt 256 --repeats 7
    python -m engine.bench.bench_prefill_breakdown CHECKPOINT --prompt 512 --layer 0

CHECKPOINT is what `models.generate` loads (an HF folder or a GGUF file, served in its own dtype and formats). Timed,
round-robin (each repeat runs every part once, so load on a shared machine falls on all of them alike), medians:

- `prefill`: `Generator.prefill_s` of one prompt of `--prompt` tokens (what `engine.bench.peers.interleaved
  --phase prefill` reports), with the minor page faults of the call (`ru_minflt`: fresh pages of XLA's buffers);
- `prefill, no experts`: the same program with an executor that returns zeros (everything but the routed experts);
- `prefill, last layer on all tokens`: the same pass with routing capture, which runs the last decoder layer's
  feed-forward on every token (the prefill runs it on the last token only, `models.transformer.trims_last_layer`, as
  llama.cpp skips unused tokens): the A/B of that skip;
- per decoder layer (`--layer`, times the number of layers of its structure): the routed experts on the prompt's own
  routing (the in-memory executor's call), the attention's input projection (q|k|v) and output projection, the
  attention core (norm, rope, scores, softmax, cache write: the attention block less its two projections), the router;
- once per prompt: the embedding lookup and the LM head on the last token (final norm included).

The prefill runs the last decoder layer's router and experts on the last token only (`models.transformer.
trims_last_layer`, as llama.cpp skips unused tokens): the summary counts them for the other layers like `--layer`.

`rest` is the prefill less the parts: the glue XLA runs between them (residual adds, norms, the gather / scatter
around the experts, copies) and what the parts cost only inside one program (or save there). Parts timed alone run
with warm inputs, so their sum can differ from the whole by the page faults of the whole program's fresh buffers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from engine.bench.peers.common import prompt_ids


class ZeroExperts:
    """An expert executor whose output is zero: the prefill without its routed experts (routing still runs)."""

    layer_free = True

    def __hash__(self) -> int:
        return hash(type(self))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ZeroExperts)

    def __call__(self, layer: int, x: jax.Array, routing: Any, experts: Any) -> jax.Array:
        return jnp.zeros(x.shape, jnp.float32)


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def timed(fn: Callable[[], Any]) -> tuple[float, int, float]:
    """Wall seconds, minor page faults and process CPU seconds of one call of `fn` (its outputs waited for). Under
    load the CPU time is the steadier figure: a thread waiting for a core costs it nothing."""
    f, c, t = minor_faults(), cpu_seconds(), time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t, minor_faults() - f, cpu_seconds() - c


def layer_parts(model: Any, layer_index: int, prompt: np.ndarray, gen: Any) -> dict[str, Callable[[], Any]]:
    """Each per-layer part as a thunk over inputs of the prompt's shapes (the experts on the prompt's own routing)."""
    from models.moe import InMemoryExperts, Routing
    from models.transformer import attention_inputs, init_cache, model_rope

    layer = model.layers[layer_index]
    if layer.moe is None or layer.moe.experts is None:
        raise SystemExit(f"--layer {layer_index}: not an MoE layer with its experts in memory")
    B, S = prompt.shape
    H = model.cfg.hidden_size
    capture = gen.generate_capture(prompt)
    li = list(model.moe_layers).index(layer_index)
    # the capture covers the prompt padded (on the left) to the Generator's bucket: keep the prompt's own columns
    g = jnp.asarray(capture.hidden[li][:, -S:].reshape(B * S, H))
    routing = Routing(experts=jnp.asarray(capture.experts[li][:, -S:].reshape(B * S, -1)),
                      weights=jnp.asarray(capture.weights[li][:, -S:].reshape(B * S, -1)), logits=jnp.zeros((B * S, 1)))
    x = g.reshape(B, S, H)
    executor = InMemoryExperts()
    experts = jax.jit(lambda g, r: executor(layer_index, g, r, layer.moe.experts))
    qkv, o = jax.jit(lambda x: layer.attn.qkv(x)), jax.jit(lambda x: layer.attn.o(x))
    out_width = layer.attn.o.shape[1] if hasattr(layer.attn.o, "shape") else layer.attn.o.weight[...].shape[1]
    o_in = jnp.asarray(np.random.default_rng(0).standard_normal((B, S, out_width)) * 0.1, x.dtype)
    cache = init_cache(model, B, gen.capacity(S), gen.cache_dtype)
    valid = jnp.ones((B, S), bool)
    positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    ai, cache = attention_inputs(model.cfg, cache, positions, valid, empty_cache=True)  # as the prefill runs it
    attend = jax.jit(lambda x, c, ai: layer.attend(x, ai, c, model_rope(model.cfg)))  # ai an argument: not folded
    router = jax.jit(lambda g: layer.moe.router(g))
    layer_cache = cache.layers[layer_index]
    return {"experts": lambda: experts(g, routing), "attention, q|k|v projection": lambda: qkv(x),
            "attention, output projection": lambda: o(o_in), "attention block": lambda: attend(x, layer_cache, ai),
            "router": lambda: router(g)}


def once_parts(model: Any, prompt: np.ndarray) -> dict[str, Callable[[], Any]]:
    tokens = jnp.asarray(prompt, jnp.int32)
    embed = jax.jit(lambda t: model.embed_tokens(t))
    last = embed(tokens)[:, -1]
    head = jax.jit(lambda h: model.logits(h))
    return {"embedding": lambda: embed(tokens), "LM head (last token)": lambda: head(last)}


class Prefill:
    """One Generator's prefill of the prompt (the interleaved bench's call) and its capture of the routing."""

    def __init__(self, model: Any, executor: Any = None, pad: Optional[int] = None, capture: bool = False):
        from models.generation import Generator, SamplingParams

        self.gen = Generator(model, capture=capture) if executor is None else Generator(model, executor=executor,
                                                                                         capture=capture)
        self.greedy, self.pad, self.model = SamplingParams(0.0, 1.0, 0), pad, model

    @property
    def cache_dtype(self) -> Any:
        return self.gen.cache_dtype

    def capacity(self, S: int) -> int:
        from models.generation import bucket

        return bucket(S + 1, self.gen.cache_bucket)

    def __call__(self, prompt: np.ndarray) -> float:
        return self.gen.generate(prompt.tolist(), 1, self.greedy, None, self.pad).prefill_s

    def generate_capture(self, prompt: np.ndarray) -> Any:
        from models.generation import Generator

        cap = Generator(self.model, capture=True, capture_hidden=True)
        return cap.generate(prompt.tolist(), 1, self.greedy, None, self.pad).prefill_capture


def measure(parts: dict[str, Callable[[], Any]], repeats: int) -> dict[str, dict[str, float]]:
    """Every part `repeats` times, round-robin (order reversed every other repeat): median seconds and faults."""
    for fn in parts.values():
        timed(fn)  # compile, first touch
    names = list(parts)
    runs: dict[str, list[tuple[float, int, float]]] = {n: [] for n in names}
    for r in range(repeats):
        for n in (names if r % 2 == 0 else names[::-1]):
            runs[n].append(timed(parts[n]))
    return {n: {"ms": float(np.median([v[0] for v in runs[n]])) * 1e3,
                "ms_min": float(np.min([v[0] for v in runs[n]])) * 1e3,
                "cpu_ms": float(np.median([v[2] for v in runs[n]])) * 1e3,
                "minor_faults": float(np.median([v[1] for v in runs[n]]))} for n in names}


def breakdown(checkpoint: str, prompt_len: int, repeats: int, layer_index: int, whole_only: bool = False) -> dict:
    from omegaconf import OmegaConf

    from models.loading import load_model, model_dtype, open_model_checkpoint

    spec = OmegaConf.create({"checkpoint": checkpoint, "arch": None, "name": "breakdown"})
    opened = open_model_checkpoint(spec)
    cfg, model, _ = load_model(spec, dtype=model_dtype("auto", opened), opened=opened)
    prompt = prompt_ids(1, prompt_len, cfg.vocab_size)
    whole, bare = Prefill(model, pad=cfg.pad_token_id), Prefill(model, ZeroExperts(), cfg.pad_token_id)
    untrimmed = Prefill(model, pad=cfg.pad_token_id, capture=True)
    parts = {"prefill": lambda: whole(prompt), "prefill, no experts": lambda: bare(prompt),
             "prefill, last layer on all tokens": lambda: untrimmed(prompt)}
    if whole_only:
        return {"checkpoint": checkpoint, "prompt": prompt_len, "repeats": repeats, "parts": measure(parts, repeats)}
    per_layer = layer_parts(model, layer_index, prompt, whole)
    parts.update(per_layer)
    parts.update(once_parts(model, prompt))
    result = measure(parts, repeats)
    like = sum(1 for l in model.layers if l.is_moe == model.layers[layer_index].is_moe)
    # the last decoder layer's router and experts run on the last token only (`trims_last_layer`): not counted
    full_rows = like - int(model.layers[-1].is_moe == model.layers[layer_index].is_moe)
    attn = result["attention block"]["ms"]
    proj = result["attention, q|k|v projection"]["ms"] + result["attention, output projection"]["ms"]
    summary = {"experts": full_rows * result["experts"]["ms"], "attention projections": like * proj,
               "attention core": like * (attn - proj), "router": full_rows * result["router"]["ms"],
               "embedding": result["embedding"]["ms"], "LM head (last token)": result["LM head (last token)"]["ms"]}
    summary["rest"] = result["prefill"]["ms"] - sum(summary.values())
    return {"checkpoint": checkpoint, "prompt": prompt_len, "repeats": repeats, "layer": layer_index,
            "layers_like_it": like, "parts": result, "summary_ms": summary}


def report(res: dict) -> None:
    p = res["parts"]
    total = p["prefill"]["ms"]
    print(f"{res['checkpoint']}: {res['prompt']}-token prefill, medians of {res['repeats']} (round-robin)")
    for name, v in p.items():
        print(f"  {name:34s} {v['ms']:8.1f} ms (min {v['ms_min']:7.1f}, CPU {v['cpu_ms']:7.1f})  minor faults "
              f"{v['minor_faults']:8.0f}")
    if "summary_ms" not in res:
        return
    print(f"  per prefill ({res['layers_like_it']} layer(s) like layer {res['layer']}):")
    for name, ms in res["summary_ms"].items():
        print(f"    {name:30s} {ms:8.1f} ms  {100 * ms / total:5.1f} %")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--layer", type=int, default=0, help="the MoE layer whose parts are timed")
    ap.add_argument("--whole-only", action="store_true", help="time the prefill and its no-experts twin only")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    res = breakdown(a.checkpoint, a.prompt, a.repeats, a.layer, a.whole_only)
    report(res)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
