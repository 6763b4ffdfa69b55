"""HF transformers peer: load time, peak memory and greedy decode speed of a checkpoint in bf16.

    python -m engine.bench.peers.hf_peer CKPT --batch 1 --prompt 32 --new 16 --out result.json
    python -m engine.bench.peers.hf_peer CKPT --logits ids.json --logits-out hf.npy

`AutoModelForCausalLM.from_pretrained(CKPT, dtype=torch.bfloat16)` with torch using every core.

Timing: `load_s` is `from_pretrained` alone (imports excluded). Decoding is our own greedy loop over the
model's forward with a `DynamicCache`, so each step is timed by itself: one prefill forward over the B
prompts (random ids, seeded, the same as the other peers'), then `new` forwards of one token per
sequence. Decode tok/s = B * new / (sum of those `new` steps' times): prefill is excluded, and there
is no `generate()` overhead (logits processors, stopping criteria) in the figure. A short warm-up
(prompt + 2 steps) runs first, then `--repeats` timed runs; the best is reported (median and all runs
in the JSON: on a shared 2-core machine a third busy process slows torch's many small matmuls,
each a barrier of its two threads, several-fold). Peak memory is sampled every 10 ms from before the
load to the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

from engine.bench.peers.common import MemWatch, finish, prompt_ids, time_batch



def greedy(model, prompts, new: int) -> dict:
    import inspect

    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)  # filled in place by every forward
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    ids = torch.as_tensor(prompts, dtype=torch.long)
    with torch.inference_mode():
        t = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{key: cache})
        nxt = out.logits[:, -1].argmax(-1)
        prefill = time.perf_counter() - t
        tokens, steps = [nxt], []
        for _ in range(new):
            t = time.perf_counter()
            out = model(input_ids=nxt[:, None], use_cache=True, logits_to_keep=1, **{key: cache})
            nxt = out.logits[:, -1].argmax(-1)
            steps.append(time.perf_counter() - t)
            tokens.append(nxt)
    return {"prefill_s": prefill, "step_s": steps, "tokens": torch.stack(tokens, 1).tolist()}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="transformers bf16 decode speed / logits of a checkpoint")
    ap.add_argument("checkpoint")
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    ap.add_argument("--logits", help="JSON list of token ids: write the logits of every position instead")
    ap.add_argument("--logits-out")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="float32: a reference for the logits check (weights upcast)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed runs per batch size (after a warm-up): the best is reported")
    ap.add_argument("--out")
    a = ap.parse_args(argv)

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(a.threads or os.cpu_count() or 1)
    transformers.logging.set_verbosity_error()
    watch = MemWatch().start()
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(a.checkpoint, dtype=getattr(torch, a.dtype)).eval()
    load_s = time.perf_counter() - t
    if a.logits:
        ids = json.loads(Path(a.logits).read_text())
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([ids])).logits[0].float().numpy()
        np.save(a.logits_out, logits)
        print(json.dumps({"logits": a.logits_out, "n": len(ids)}))
        return 0
    result = {"system": "transformers", "version": transformers.__version__, "torch": torch.__version__,
              "checkpoint": a.checkpoint, "dtype": a.dtype, "load_s": load_s, "threads": torch.get_num_threads(),
              "prompt_len": a.prompt, "new_tokens": a.new, "repeats": a.repeats, "batches": {}}
    vocab = model.config.vocab_size
    for B in a.batch:
        result["batches"][str(B)] = time_batch("transformers", lambda p, n: greedy(model, p, n),
                                               prompt_ids(B, a.prompt, vocab), a.new, a.repeats)
    return finish(result, watch, a.out)


if __name__ == "__main__":
    sys.exit(main())
