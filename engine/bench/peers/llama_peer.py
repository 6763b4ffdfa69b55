"""llama.cpp peer: load time, peak memory and greedy decode speed of a GGUF at batch 1 and 8.

    python -m engine.bench.peers.llama_peer MODEL.gguf --batch 1 8 --prompt 32 --new 16 --out result.json
    python -m engine.bench.peers.llama_peer MODEL.gguf --logits ids.json --logits-out llama.npy

Runs in the venv holding llama-cpp-python (needs only it, numpy and the standard library). Uses the
low-level API for every batch size: one context per batch size with `n_seq_max = B`; the B prompts
(random ids, seeded, the same for every peer) are prefilled in one `llama_decode`, then each decode
step submits one `llama_batch` of B tokens, one per sequence, and takes each sequence's argmax.
The B prompts are the same random ids for every peer (`common.prompt_ids`).

Timing: `load_s` is model load + first context creation (llama.cpp mmaps the file and, on Linux,
populates the mapping). After a warm-up (prompt + 2 steps, cache cleared), `--repeats` runs time
the prefill and each of `new` decode steps separately; decode tok/s = B * new / (sum of the decode
steps' times), so prefill is excluded; the best run is reported (median and all runs in the JSON:
on a shared 2-core machine a third busy process slows a run several-fold). Peak memory is sampled
every 10 ms (RssAnon / RssFile / VmRSS) from before the load to the end. With mmap (the default)
the weights are file pages, not anonymous memory: compare peak RSS, not RssAnon, with the others.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

from engine.bench.peers.common import MemWatch, finish, prompt_ids, time_batch



class LlamaCpp:
    def __init__(self, path: str, threads: int, mmap: bool = True, quiet: bool = True, repack: bool = True):
        import llama_cpp as lc

        self.lc = lc
        self.threads = threads
        if quiet:
            self._log_cb = lc.llama_log_callback(lambda level, text, user: None)
            lc.llama_log_set(self._log_cb, ctypes.c_void_p(0))
        lc.llama_backend_init()
        mp = lc.llama_model_default_params()
        mp.use_mmap = mmap
        if not repack:  # keep the weights in the mapped file (no copy into ggml-cpu's repacked, anonymous buffers)
            if not hasattr(mp, "use_extra_bufts"):
                raise RuntimeError("--no-repack: this llama-cpp-python has no llama_model_params.use_extra_bufts")
            mp.use_extra_bufts = False
        mp.n_gpu_layers = 0
        self.model = lc.llama_model_load_from_file(path.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path} (rerun with --verbose for its log)")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.ctx = None

    def context(self, n_seq: int, n_ctx_seq: int, n_batch: int) -> None:
        lc = self.lc
        if self.ctx is not None:
            lc.llama_free(self.ctx)
        cp = lc.llama_context_default_params()
        cp.n_ctx = n_seq * n_ctx_seq
        cp.n_batch = cp.n_ubatch = max(n_batch, 32)
        cp.n_seq_max = n_seq
        cp.n_threads = cp.n_threads_batch = self.threads
        cp.no_perf = True
        self.ctx = lc.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")

    def clear(self) -> None:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)

    def decode(self, tokens: list[int], pos: list[int], seqs: list[int], want: list[bool]) -> list[np.ndarray]:
        """One llama_decode of these tokens; the logits (copies) of those with `want`."""
        lc = self.lc
        n = len(tokens)
        batch = lc.llama_batch_init(n, 0, 1)
        try:
            for i in range(n):
                batch.token[i] = int(tokens[i])
                batch.pos[i] = int(pos[i])
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = int(seqs[i])
                batch.logits[i] = 1 if want[i] else 0
            batch.n_tokens = n
            rc = lc.llama_decode(self.ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            out = []
            for i in range(n):
                if want[i]:
                    ptr = lc.llama_get_logits_ith(self.ctx, i)
                    out.append(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy())
            return out
        finally:
            lc.llama_batch_free(batch)

    def generate(self, prompts: np.ndarray, new: int) -> dict:
        """Greedy: prefill all sequences at once, then `new` steps of one token per sequence."""
        B, P = prompts.shape
        self.clear()
        t = time.perf_counter()
        toks = [int(x) for x in prompts.ravel()]
        pos = [j for _ in range(B) for j in range(P)]
        seqs = [s for s in range(B) for _ in range(P)]
        want = [j == P - 1 for _ in range(B) for j in range(P)]
        last = self.decode(toks, pos, seqs, want)
        prefill = time.perf_counter() - t
        nxt = [int(np.argmax(l)) for l in last]
        out = [nxt]
        steps = []
        for k in range(new):
            t = time.perf_counter()
            last = self.decode(nxt, [P + k] * B, list(range(B)), [True] * B)
            nxt = [int(np.argmax(l)) for l in last]
            steps.append(time.perf_counter() - t)
            out.append(nxt)
        return {"prefill_s": prefill, "step_s": steps, "tokens": np.array(out).T.tolist()}

    def all_logits(self, ids: list[int]) -> np.ndarray:
        self.clear()
        return np.stack(self.decode(ids, list(range(len(ids))), [0] * len(ids), [True] * len(ids)))


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="llama.cpp decode speed / logits of a GGUF")
    ap.add_argument("gguf")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-mmap", action="store_true", help="read the weights into anonymous memory")
    ap.add_argument("--no-repack", action="store_true",
                    help="serve Q4_0 / Q4_K / IQ4_NL weights from the mapped file instead of copying them into "
                         "ggml-cpu's repacked (interleaved-row) buffers, which are anonymous memory the size of "
                         "those tensors")
    ap.add_argument("--logits", help="JSON list of token ids: write the logits of every position instead")
    ap.add_argument("--logits-out")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed runs per batch size (after a warm-up): the best is reported")
    ap.add_argument("--out")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args(argv)

    watch = MemWatch().start()
    t = time.perf_counter()
    llm = LlamaCpp(a.gguf, a.threads, mmap=not a.no_mmap, quiet=not a.verbose, repack=not a.no_repack)
    if a.logits:
        ids = json.loads(Path(a.logits).read_text())
        llm.context(1, max(256, len(ids) + 8), len(ids))
        np.save(a.logits_out, llm.all_logits(ids).astype(np.float32))
        print(json.dumps({"logits": a.logits_out, "n": len(ids)}))
        return 0
    llm.context(max(a.batch), a.prompt + a.new + 16, max(a.batch) * a.prompt)
    load_s = time.perf_counter() - t
    result = {"system": "llama.cpp", "gguf": a.gguf, "gguf_bytes": os.path.getsize(a.gguf), "load_s": load_s,
              "threads": a.threads, "mmap": not a.no_mmap, "repack": not a.no_repack, "prompt_len": a.prompt, "new_tokens": a.new,
              "repeats": a.repeats, "batches": {}}
    for B in a.batch:
        llm.context(B, a.prompt + a.new + 16, B * a.prompt)
        result["batches"][str(B)] = time_batch("llama.cpp", llm.generate, prompt_ids(B, a.prompt, llm.n_vocab), a.new,
                                               a.repeats)
    return finish(result, watch, a.out)


if __name__ == "__main__":
    sys.exit(main())
