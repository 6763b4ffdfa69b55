"""A full-depth quantized MoE on this machine: moescope (`models.generate`, `engine.run`) against llama.cpp on the
same GGUF file: load time, peak anonymous and file-backed memory against the file's bytes, decode tok/s at batch
1 and 8.

    python -m engine.bench.bench_full_depth --family qwen3_moe --type q4_k_m --out /tmp/fulldepth
    python -m engine.bench.bench_full_depth --family deepseek_v2 --type q8_0 --out /tmp/fulldepth

The file is written first when it is not there (`engine.bench.full_depth_gguf`: random ggml blocks in the types
llama.cpp's preset writes, the released model's names, shapes and metadata). Then every system runs in its own
process, `--rounds` times, the order reversed every other round (so that the machine's load falls on each alike),
while this process samples the child's /proc/<pid>/status (RssAnon, RssFile) every 50 ms and its major page
faults and bytes read from disk (/proc/<pid>/stat, /proc/<pid>/io) - on a machine that cannot keep the whole file
in its page cache, those say how much of a step was spent reading the disk:

* `llama.cpp`: `engine.bench.peers.llama_peer` (mmap, one context per batch size with B parallel sequences).
  By default with `--no-repack`: this build of ggml-cpu otherwise copies every Q4_K tensor into a repacked
  (interleaved-row) buffer in anonymous memory at load - 13.9 GB of RssAnon and rising when it was stopped on
  the Q4_K_M file, which a 24 GB machine shared with other processes cannot hold beside the page cache;
  `--llama-repack` measures it that way where memory allows;
* `moescope generate`: `models.generate`'s loader and generator (`models.loading.load_model`, experts served from
  the mapped file in their blocks, and so are the embedding (rows dequantized as they are looked up), the attention
  projections, the dense and shared-expert MLPs and the LM head where the file stores them in a type the native
  kernels read; norms, routers and MLA's kv_b in bf16) in one process for both batch sizes
  (`serve-generate` below);
* `moescope run`: `python -m engine.run` at its default budget (one process per batch size; the in-memory
  comparison off: it would hold a second model).

Every system decodes the same random prompt ids (`peers.common.prompt_ids`, 32 tokens) for `--new` steps; tok/s =
B x new / the decode steps' seconds (best of `--repeats` after a warm-up; engine.run: its own decode tok/s of one
batch after its warm-up). The table gives each moescope row against llama.cpp's in the same round.

The bound the issue sets: anonymous memory <= 1.3 x the file's non-expert bytes + the device cache (engine.run's
expert cache is host memory on the CPU backend; `models.generate` has none).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[2]
LLAMA_PYTHON = "/work/llama-venv/bin/python"
SYSTEMS = ("llama.cpp", "moescope generate", "moescope run")


# ---- sampling a child process ---------------------------------------------------------------------------


class ChildWatch:
    """Peaks of a child's RssAnon / RssFile and its last major-fault and read-bytes counters, sampled every 50 ms."""

    def __init__(self, pid: int, interval: float = 0.05):
        self.pid, self.interval = pid, interval
        self.peak = {"RssAnon": 0, "RssFile": 0}
        self.majflt = 0
        self.read_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        try:
            with open(f"/proc/{self.pid}/status") as f:
                for line in f:
                    key, _, rest = line.partition(":")
                    if key in self.peak:
                        self.peak[key] = max(self.peak[key], int(rest.split()[0]) * 1024)
            with open(f"/proc/{self.pid}/stat") as f:
                self.majflt = int(f.read().rsplit(")", 1)[1].split()[9])
            with open(f"/proc/{self.pid}/io") as f:
                for line in f:
                    if line.startswith("read_bytes:"):
                        self.read_bytes = int(line.split()[1])
        except (FileNotFoundError, ProcessLookupError, PermissionError, IndexError, ValueError):
            pass

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return {"peak_anon_bytes": self.peak["RssAnon"], "peak_file_bytes": self.peak["RssFile"],
                "major_faults": self.majflt, "disk_read_bytes": self.read_bytes}


def run_watched(cmd: list[str], log: Path, timeout: float, env: dict, cwd: Optional[Path] = None) -> dict[str, Any]:
    """Run `cmd` (stdout and stderr to `log`) in `cwd` (default: this checkout), sampling its memory; returns the
    peaks, seconds and exit status."""
    t = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd or REPO, env=env)
        watch = ChildWatch(proc.pid)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        mem = watch.stop()
    return {"rc": rc, "seconds": time.perf_counter() - t, **mem}


def meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            out[key] = int(rest.split()[0]) * 1024
    return out


# ---- moescope's models.generate in one process for every batch size ---------------------------------------


def serve_generate(gguf_path: str, batches: list[int], prompt: int, new: int, repeats: int, out: str) -> int:
    """Load `gguf_path` as `models.generate` does and time its generator at each batch size (one load)."""
    import jax
    import numpy as np

    from conf import compose
    from engine.bench.peers.common import prompt_ids, time_batch
    from models.generation import Generator, bucket
    from models.loading import load_model, model_dtype, open_model_checkpoint
    from models.memory import anon_bytes
    from models.quant.dense import dense_nbytes
    from models.transformer import init_cache, param_bytes

    anon_start = anon_bytes()  # the interpreter and its imports, before any weight
    t = time.perf_counter()
    spec = compose("generate", [f"model.checkpoint={gguf_path}", "model.arch=null", "model.name=full-depth"]).model
    opened = open_model_checkpoint(spec)
    dtype = model_dtype("auto", opened)
    cfg, model, _ = load_model(spec, dtype=dtype, opened=opened)
    load_s = time.perf_counter() - t
    print(f"moescope generate: loaded in {load_s:.1f} s", flush=True)  # in the log even if a timeout cuts the run
    gen = Generator(model)
    # where the anonymous memory goes: the process before any weight, the parameters held as arrays of the run dtype
    # (norms, routers, whatever is not kept in blocks), then per batch the KV cache and what the run added on top
    result: dict[str, Any] = {"system": "moescope generate", "load_s": load_s, "dtype": np.dtype(dtype).name,
                              "anon_start": anon_start, "anon_after_load": anon_bytes(),
                              "dense_array_bytes": param_bytes(model), "dense_block_bytes": dense_nbytes(model),
                              "batches": {}, "anon_after_batch": {}, "kv_cache_bytes": {}}

    def generate(prompts: np.ndarray, n: int) -> dict[str, Any]:
        o = gen.generate(prompts.tolist(), n + 1)  # the prefill's token, then n decode steps (as llama_peer counts)
        return {"prefill_s": o.prefill_s, "step_s": [o.decode_s / n] * n, "tokens": o.tokens.tolist()}

    for B in batches:
        result["batches"][str(B)] = time_batch("moescope generate", generate, prompt_ids(B, prompt, cfg.vocab_size),
                                               new, repeats)
        kv = init_cache(model, B, bucket(bucket(prompt, gen.prompt_bucket) + new + 1, gen.cache_bucket), gen.cache_dtype)
        result["kv_cache_bytes"][str(B)] = sum(int(a.nbytes) for a in jax.tree_util.tree_leaves(kv))
        result["anon_after_batch"][str(B)] = anon_bytes()
        del kv
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


# ---- the bench ---------------------------------------------------------------------------------------------


class Bench:
    def __init__(self, a: argparse.Namespace, gguf_path: Path):
        self.a = a
        self.gguf = gguf_path
        self.dir = Path(a.out) / "results" / f"{gguf_path.stem}-{time.strftime('%H%M%S')}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "WANDB_MODE": "disabled", "WANDB_SILENT": "true",
                    "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}

    def _json(self, path: Path) -> Optional[dict]:
        return json.loads(path.read_text()) if path.is_file() else None

    def llama(self, r: int) -> dict:
        res = self.dir / f"llama-r{r}.json"
        cmd = [self.a.llama_python, "-m", "engine.bench.peers.llama_peer", str(self.gguf), "--batch",
               *map(str, self.a.batches), "--prompt", str(self.a.prompt), "--new", str(self.a.new), "--threads",
               str(self.a.threads), "--repeats", str(self.a.repeats), "--out", str(res)] + \
            ([] if self.a.llama_repack else ["--no-repack"])
        run = run_watched(cmd, self.dir / f"llama-r{r}.log", self.a.timeout, self.env)
        d = self._json(res) or {}
        return {**run, "load_s": d.get("load_s"),
                "tok_s": {B: v["decode_tok_s"] for B, v in d.get("batches", {}).items()}}

    def generate(self, r: int) -> dict:
        res = self.dir / f"generate-r{r}.json"
        cmd = [sys.executable, "-m", "engine.bench.bench_full_depth", "serve-generate", str(self.gguf), "--batches",
               *map(str, self.a.batches), "--prompt", str(self.a.prompt), "--new", str(self.a.new), "--repeats",
               str(self.a.repeats), "--result", str(res)]
        run = run_watched(cmd, self.dir / f"generate-r{r}.log", self.a.timeout, self.env)
        d = self._json(res) or {}
        breakdown = ("anon_start", "anon_after_load", "dense_array_bytes", "dense_block_bytes", "kv_cache_bytes",
                     "anon_after_batch")
        return {**run, **{k: d.get(k) for k in breakdown}, "load_s": d.get("load_s"),
                "tok_s": {B: v["decode_tok_s"] for B, v in d.get("batches", {}).items()}}

    def engine_run(self, r: int) -> dict:
        out: dict[str, Any] = {"tok_s": {}, "runs": {}}
        for B in self.a.batches:
            run_dir = self.dir / f"run-r{r}-b{B}"
            cmd = [sys.executable, "-m", "engine.run", f"model.checkpoint={self.gguf}", "model.arch=null",
                   "model.name=full-depth", "compare_in_memory=false", f"workload.batch_size={B}",
                   "workload.num_batches=1", f"workload.prompt_len={self.a.prompt}",
                   f"workload.gen_len={self.a.new + 1}", "wandb.mode=disabled", f"hydra.run.dir={run_dir}"]
            run = run_watched(cmd, self.dir / f"run-r{r}-b{B}.log", self.a.timeout, self.env)
            d = self._json(run_dir / "results.json") or {}
            run.update({k: d.get(k) for k in ("load_s", "decode_tokens_per_s", "cache_slots", "expert_cache_bytes",
                                              "anon_after_load_bytes", "anon_after_warm_up_bytes",
                                              "anon_after_serving_bytes", "anon_growth_serving_bytes")})
            out["runs"][str(B)] = run
            out["tok_s"][str(B)] = d.get("decode_tokens_per_s")
        runs = list(out["runs"].values())
        out.update(load_s=min((x["load_s"] for x in runs if x.get("load_s")), default=None),
                   peak_anon_bytes=max(x["peak_anon_bytes"] for x in runs),
                   peak_file_bytes=max(x["peak_file_bytes"] for x in runs),
                   major_faults=max(x["major_faults"] for x in runs), disk_read_bytes=max(x["disk_read_bytes"] for x in runs),
                   rc=max(x["rc"] for x in runs), seconds=sum(x["seconds"] for x in runs))
        return out

    def rounds(self) -> dict:
        jobs = {"llama.cpp": self.llama, "moescope generate": self.generate, "moescope run": self.engine_run}
        jobs = {k: v for k, v in jobs.items() if k in self.a.systems}
        results: dict[str, list[dict]] = {k: [] for k in jobs}
        for r in range(self.a.rounds):
            order = list(jobs) if r % 2 == 0 else list(jobs)[::-1]
            for name in order:
                before = meminfo()
                row = jobs[name](r)
                row["available_before_bytes"] = before.get("MemAvailable")
                results[name].append(row)
                print(f"  round {r + 1} {name}: rc {row['rc']}, load {fmt(row.get('load_s'), '.1f')} s, "
                      + ", ".join(f"b{B} {fmt(v, '.2f')} tok/s" for B, v in row["tok_s"].items())
                      + f", anon {row['peak_anon_bytes'] / 1e9:.2f} GB, file {row['peak_file_bytes'] / 1e9:.2f} GB, "
                        f"major faults {row['major_faults']}, disk read {row['disk_read_bytes'] / 1e9:.1f} GB "
                        f"({row['seconds']:.0f} s)", flush=True)
                (self.dir / "rounds.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
        return results


def fmt(v: Optional[float], spec: str) -> str:
    return "-" if v is None else format(v, spec)


def file_bytes_split(path: Path) -> dict[str, int]:
    """The file's bytes: routed experts (`*_exps`) and everything else."""
    import gguf

    reader = gguf.GGUFReader(path, "r")
    experts = sum(int(t.n_bytes) for t in reader.tensors if "_exps." in t.name)
    return {"file": path.stat().st_size, "experts": experts, "non_expert": path.stat().st_size - experts}


def table(results: dict, sizes: dict[str, int], batches: list[int]) -> str:
    """Markdown: per system the median over rounds of load, peaks and tok/s; moescope's tok/s against llama.cpp's
    in the same round (median of the per-round ratios)."""
    import numpy as np

    def med(xs: list) -> Optional[float]:
        xs = [x for x in xs if x is not None]
        return float(np.median(xs)) if xs else None

    head = ["system", "load s", "peak anon GB", "peak file GB", "anon / non-expert", "major faults"] + \
        [f"b{B} tok/s" for B in batches] + [f"b{B} vs llama.cpp" for B in batches]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    ref = results.get("llama.cpp", [])
    for name, rows in results.items():
        ok = [r for r in rows if r["rc"] == 0] or rows
        cells = [name, fmt(med([r.get("load_s") for r in ok]), ".1f"),
                 fmt(med([r["peak_anon_bytes"] / 1e9 for r in ok]), ".2f"),
                 fmt(med([r["peak_file_bytes"] / 1e9 for r in ok]), ".2f"),
                 fmt(med([r["peak_anon_bytes"] / sizes["non_expert"] for r in ok]), ".2f"),
                 fmt(med([r["major_faults"] for r in ok]), ".0f")]
        cells += [fmt(med([r["tok_s"].get(str(B)) for r in ok]), ".2f") for B in batches]
        for B in batches:
            ratios = [r["tok_s"].get(str(B)) / l["tok_s"][str(B)] for r, l in zip(rows, ref)
                      if r["tok_s"].get(str(B)) and l["tok_s"].get(str(B))] if name != "llama.cpp" else []
            cells.append(fmt(med(ratios), ".2f") + "x" if ratios else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve-generate":
        ap = argparse.ArgumentParser(description="models.generate on a GGUF file at several batch sizes")
        ap.add_argument("gguf")
        ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
        ap.add_argument("--prompt", type=int, default=32)
        ap.add_argument("--new", type=int, default=16)
        ap.add_argument("--repeats", type=int, default=2)
        ap.add_argument("--result", required=True)
        s = ap.parse_args(argv[1:])
        return serve_generate(s.gguf, s.batches, s.prompt, s.new, s.repeats, s.result)
    from engine.bench import full_depth_gguf as writer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=sorted(writer.FULL_DEPTH), required=True)
    ap.add_argument("--type", choices=writer.PRESETS, required=True)
    ap.add_argument("--out", required=True, help="folder for the file and the results")
    ap.add_argument("--layers", type=int, help="decoder layers (default: the released model's)")
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per system run")
    ap.add_argument("--llama-python", default=LLAMA_PYTHON)
    ap.add_argument("--llama-repack", action="store_true",
                    help="let llama.cpp copy Q4_K / Q4_0 weights into its repacked buffers (anonymous memory about "
                         "the size of those tensors: a Q4_K_M file's whole expert bytes; off by default)")
    ap.add_argument("--delete", action="store_true", help="delete the GGUF file at the end")
    a = ap.parse_args(argv)
    cfg = writer.model_config(a.family, a.layers)
    path = writer.default_path(a.out, a.family, a.type, cfg.num_hidden_layers)
    if not path.is_file():
        print(f"writing {path}", flush=True)
        print(json.dumps(writer.write(cfg, a.type, path)), flush=True)
    sizes = file_bytes_split(path)
    released = writer.RELEASED.get((a.family, a.type))
    print(f"{path.name}: {sizes['file'] / 1e9:.2f} GB ({sizes['experts'] / 1e9:.2f} GB routed experts, "
          f"{sizes['non_expert'] / 1e9:.2f} GB the rest)"
          + (f"; released {released[0]}: {released[1] / 1e9:.1f} GB" if released else ""), flush=True)
    bench = Bench(a, path)
    results = bench.rounds()
    text = table(results, sizes, a.batches)
    summary = {"file": str(path), "sizes": sizes, "released": released, "args": vars(a), "results": results,
               "table": text, "host": {k: meminfo().get(k) for k in ("MemTotal", "MemAvailable")}}
    (bench.dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print("\n" + text, flush=True)
    if a.delete:
        path.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
