"""moescope (in memory) and llama.cpp in one process on the same weights, decode bursts alternated.

    python -m engine.bench.peers.interleaved CHECKPOINT MODEL.gguf --llama-site SITE [--batch 1] [--bursts 16]
    python -m engine.bench.peers.interleaved MODEL.gguf MODEL.gguf --llama-site SITE     # both on the same file
    python -m engine.bench.peers.interleaved MODEL.gguf MODEL.gguf --llama-site SITE --phase prefill --prompt 256

CHECKPOINT is what moescope loads: an HF folder, or a GGUF file (its experts served in their blocks, as
`model.checkpoint=<file.gguf>` does), so that both systems can run on the same bytes.

Why: this VM's memory read rate moves up to 2x within seconds (where the host places the two vCPUs), and a
decode step at batch 1 reads the weights once, so two systems timed one after the other in separate processes
differ by whatever the read rate did in between (the 0.69x "moescope vs llama.cpp" of an earlier bench was
that). Here both run in one process, in bursts of `--new` greedy decode steps on the same random prompt,
alternating (and swapping which goes first every other burst), with `--settle` seconds between bursts so the
other runtime's idle threads stop spinning before a burst starts. Each burst pair gives a ratio of decode
speeds measured seconds apart; the median ratio and its quartiles are the result.

SITE is the site-packages folder of a venv holding llama-cpp-python (the project venv does not); it is
appended to sys.path. moescope runs as `models.generate` does (bf16, native kernels); llama.cpp through
`engine.bench.peers.llama_peer.LlamaCpp` on every CPU (`--threads`). Timing: moescope's `decode_s` of a
generation of `new + 1` tokens (the prefill's token excluded); llama.cpp's decode steps after its first.
`--phase prefill` times the prompt instead (each burst one prefill of `--batch` x `--prompt` tokens: moescope's
`prefill_s`, llama.cpp's one `llama_decode` of the whole prompt with `n_batch` = `n_ubatch` = every prompt token).

What a prefill computes: llama.cpp runs the LAST decoder layer's residual and feed-forward only for the tokens
whose logits are asked for (one per sequence here: "skip computing output for unused tokens" in its model graphs),
and so does moescope (`models.transformer.forward(..., last_only=True)`). A file of L layers therefore prefills the
experts of L - 1 layers for every prompt token: on a 1-layer file a prefill times attention and one token's
experts, so time expert-heavy prefill on files of 2 or more layers (the bench prints the depth).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from engine.bench.peers.common import prompt_ids


def moescope_burst(checkpoint: str, prompts: np.ndarray, new: int, prefill: bool = False) -> Callable[[], float]:
    """Loads the checkpoint in its own dtype and returns a function timing one burst (seconds per step; with
    `prefill`, seconds of the prompt's prefill)."""
    from omegaconf import OmegaConf

    from models.generation import Generator, SamplingParams
    from models.loading import load_model, model_dtype, open_model_checkpoint

    spec = OmegaConf.create({"checkpoint": checkpoint, "arch": None, "name": "interleaved"})
    opened = open_model_checkpoint(spec)
    cfg, model, _ = load_model(spec, dtype=model_dtype("auto", opened), opened=opened)
    gen = Generator(model)
    greedy = SamplingParams(0.0, 1.0, 0)

    def burst() -> float:
        out = gen.generate(prompts.tolist(), 1 if prefill else new + 1, greedy, None, cfg.pad_token_id)
        return out.prefill_s if prefill else out.decode_s / new

    burst()  # compiles
    return burst


def llama_burst(gguf: str, prompts: np.ndarray, new: int, threads: int, prefill: bool = False) -> Callable[[], float]:
    from engine.bench.peers.llama_peer import LlamaCpp

    llm = LlamaCpp(gguf, threads)
    B, P = prompts.shape
    llm.context(B, P + new + 16, B * P)

    def burst() -> float:
        if prefill:
            return float(llm.generate(prompts, 0)["prefill_s"])
        steps = llm.generate(prompts, new)["step_s"][1:]
        return float(np.sum(steps)) / len(steps)

    burst()
    return burst


def alternate(ours: Callable[[], float], theirs: Callable[[], float], bursts: int, settle: float, unit: str = "step"
              ) -> list[tuple[float, float]]:
    """(moescope, llama.cpp) seconds per step of each burst pair, the first system swapped every other pair."""
    pairs = []
    for i in range(bursts):
        order = (ours, theirs) if i % 2 == 0 else (theirs, ours)
        times = {}
        for fn in order:
            time.sleep(settle)
            times[fn] = fn()
        pairs.append((times[ours], times[theirs]))
        print(f"  burst {i:2d}: moescope {times[ours] * 1e3:6.1f} ms/{unit}, llama.cpp {times[theirs] * 1e3:6.1f} "
              f"ms/{unit}", flush=True)
    return pairs


def summarise(pairs: list[tuple[float, float]], batch: int, tokens: int = 1) -> dict:
    """Medians and quartiles of the burst pairs; `tokens` per sequence a burst's time covers (1: a decode step;
    the prompt's length for a prefill)."""
    ours = np.array([p[0] for p in pairs])
    theirs = np.array([p[1] for p in pairs])
    ratio = theirs / ours  # moescope's speed over llama.cpp's, burst by burst
    return {"batch": batch, "bursts": len(pairs), "moescope_ms_per_step": (ours * 1e3).tolist(),
            "llama_ms_per_step": (theirs * 1e3).tolist(),
            "moescope_over_llama_median": float(np.median(ratio)),
            "moescope_over_llama_q1": float(np.percentile(ratio, 25)),
            "moescope_over_llama_q3": float(np.percentile(ratio, 75)),
            "bursts_moescope_faster": int(np.sum(ratio > 1.0)),
            "moescope_tok_s_median": float(batch * tokens / np.median(ours)),
            "llama_tok_s_median": float(batch * tokens / np.median(theirs))}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("gguf")
    ap.add_argument("--llama-site", required=True, help="site-packages of a venv with llama-cpp-python")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=16, help="decode steps per burst")
    ap.add_argument("--bursts", type=int, default=16)
    ap.add_argument("--settle", type=float, default=0.5, help="seconds between bursts")
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: every CPU)")
    ap.add_argument("--phase", choices=("decode", "prefill"), default="decode",
                    help="what a burst times: --new decode steps, or the prompt's prefill")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if not (Path(a.llama_site) / "llama_cpp").is_dir():
        raise SystemExit(f"--llama-site: no llama_cpp package in {a.llama_site}")
    sys.path.append(a.llama_site)
    from models.loading import open_model_checkpoint
    from models.memory import cpu_count
    from omegaconf import OmegaConf

    opened = open_model_checkpoint(OmegaConf.create({"checkpoint": a.checkpoint}))  # headers only
    prompts = prompt_ids(a.batch, a.prompt, opened.cfg.vocab_size)
    prefill = a.phase == "prefill"
    if prefill:
        layers = opened.cfg.num_hidden_layers
        print(f"prefill of {a.prompt} tokens, {layers} decoder layer(s): every token through the feed-forward of "
              f"{layers - 1}, the last layer's for the last token only (both engines)", flush=True)
    ours = moescope_burst(a.checkpoint, prompts, a.new, prefill)
    theirs = llama_burst(a.gguf, prompts, a.new, a.threads or cpu_count(), prefill)
    pairs = alternate(ours, theirs, a.bursts, a.settle, "prompt" if prefill else "step")
    result = summarise(pairs, a.batch, a.prompt if prefill else 1)
    result.update(moescope_checkpoint=str(a.checkpoint), gguf=str(a.gguf), phase=a.phase, prompt=a.prompt)
    print(f"moescope / llama.cpp {a.phase} speed at b{a.batch}: median {result['moescope_over_llama_median']:.2f} "
          f"(quartiles {result['moescope_over_llama_q1']:.2f}-{result['moescope_over_llama_q3']:.2f}; moescope "
          f"faster in {result['bursts_moescope_faster']} of {result['bursts']} bursts)", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
