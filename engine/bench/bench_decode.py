"""Decode speed of the engine vs transformers (and, optionally, llama.cpp) on one tiny Mixtral checkpoint.

    python -m engine.bench.bench_decode                          # random 29M Mixtral (conf/model/bench_mixtral_29m)
    python -m engine.bench.bench_decode --checkpoint PATH        # any HF Mixtral-family folder
    python -m engine.bench.bench_decode --llama-python /tmp/llamavenv/bin/python \\
        --llama-tools ../shared/tools/llama_cpp_peer             # add llama.cpp's figure (batch 1)

Issue 2 §4: greedy decode at batch 1 and 16, prompt 64, 64 new tokens, fp32 on CPU; targets: the
engine at least 3x transformers at batch 16 and at least llama.cpp's tokens/s at batch 1. The
checkpoint is a random transformers init written with `save_pretrained` (or the one given), read
by both sides. Engine and transformers repeats alternate in this process (best of `--repeats`);
llama.cpp runs after them in a subprocess with its own Python (never a dependency of moescope).

Two figures per system: decode-only tokens/s (tokens produced by the decode loop / its time; the
first token comes from prefill) and end-to-end tokens/s (all new tokens / prefill + decode time).
For transformers the decode time is generate(64 new) - generate(1 new); llama.cpp's likewise, from
two runs of the peer script (which keeps the prompt cached between its repeats, so it has no
end-to-end figure: see `llama_cpp_figure`). Figures are printed (and optionally written as
JSON); nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from engine.bench.kernel_ceiling import Ceiling

BENCH_MODEL = "bench_mixtral_29m"


@dataclass
class Figure:
    """Best-of-repeats speed of one system at one batch size."""

    system: str
    batch: int
    decode_tok_s: Optional[float]
    end_to_end_tok_s: Optional[float]
    decode_ms_per_step: Optional[float]
    prefill_ms: Optional[float]
    repeats: int


def write_random_checkpoint(folder: Path, seed: int) -> Path:
    """A random transformers init of the benchmark shape, saved with `save_pretrained` (fp32)."""
    import torch
    import transformers

    from conf import compose
    from models.hf import config_to_hf
    from models.loading import resolve_model_config

    cfg = resolve_model_config(compose("generate", [f"model={BENCH_MODEL}"]).model)
    hf_cfg = transformers.AutoConfig.for_model(**config_to_hf(cfg))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).eval()
    model.save_pretrained(folder)
    return folder


def make_prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> np.ndarray:
    """int64 [batch, prompt_len] random token ids clear of the usual special ids."""
    return np.random.default_rng(seed).integers(3, vocab, (batch, prompt_len))


class EngineRunner:
    """moescope's `Generator` (fp32, in-memory experts): one warm-up (compiles), then timed runs."""

    def __init__(self, folder: Path):
        from models.generation import Generator
        from models.hf import load_hf

        self.cfg, model = load_hf(folder)
        self.generator = Generator(model)

    def run(self, prompts: np.ndarray, new_tokens: int) -> tuple[float, float, np.ndarray]:
        """(prefill s, decode s, tokens [B, new])."""
        out = self.generator.generate(prompts.tolist(), new_tokens)
        return out.prefill_s, out.decode_s, out.tokens


class TransformersRunner:
    """transformers eager PyTorch `generate(do_sample=False)`, all rows of equal length (no padding)."""

    def __init__(self, folder: Path, threads: Optional[int]):
        import torch
        import transformers

        if threads:
            torch.set_num_threads(threads)
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def generate(self, prompts: np.ndarray, new_tokens: int) -> tuple[float, np.ndarray]:
        torch = self.torch
        ids = torch.tensor(prompts, dtype=torch.long)
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=None,
                                      pad_token_id=0)
            return time.perf_counter() - t0, out[:, prompts.shape[1]:].numpy()


def best_of(repeats: int, runs: list[Callable[[], None]]) -> None:
    """Alternate the runs `repeats` times (so a load change on the machine hits every system alike)."""
    for _ in range(repeats):
        for run in runs:
            run()


def bench_batch(engine: EngineRunner, hf: TransformersRunner, batch: int, prompt_len: int, new_tokens: int,
                repeats: int, seed: int, console: Console) -> tuple[Figure, Figure, float]:
    """Engine and transformers figures at one batch size, and the fraction of equal greedy tokens."""
    prompts = make_prompts(batch, prompt_len, engine.cfg.vocab_size, seed)
    t0 = time.perf_counter()
    engine.run(prompts, new_tokens)  # compile prefill + decode for these shapes
    console.print(f"  batch {batch}: engine compile + first run {time.perf_counter() - t0:.1f} s")
    hf.generate(prompts, 2)  # warm-up
    eng: list[tuple[float, float]] = []
    hf_full: list[float] = []
    hf_first: list[float] = []
    tokens: dict[str, np.ndarray] = {}

    def run_engine() -> None:
        prefill, decode, tokens["engine"] = engine.run(prompts, new_tokens)
        eng.append((prefill, decode))

    def run_hf() -> None:
        seconds, tokens["hf"] = hf.generate(prompts, new_tokens)
        hf_full.append(seconds)
        hf_first.append(hf.generate(prompts, 1)[0])

    best_of(repeats, [run_engine, run_hf])
    decoded = batch * (new_tokens - 1)
    best_prefill, best_decode = min(p for p, _ in eng), min(d for _, d in eng)
    engine_fig = Figure("moescope", batch, decoded / best_decode, batch * new_tokens / min(p + d for p, d in eng),
                        1e3 * best_decode / (new_tokens - 1), 1e3 * best_prefill, repeats)
    hf_decode = max(min(hf_full) - min(hf_first), 1e-9)
    hf_fig = Figure("transformers", batch, decoded / hf_decode, batch * new_tokens / min(hf_full),
                    1e3 * hf_decode / (new_tokens - 1), 1e3 * min(hf_first), repeats)
    return engine_fig, hf_fig, float((tokens["engine"] == tokens["hf"]).mean())


def llama_cpp_figure(python: str, tools: Path, folder: Path, prompt_len: int, new_tokens: int, threads: int,
                     timeout: float, console: Console) -> Optional[Figure]:
    """llama.cpp batch-1 decode tokens/s on the same weights, via the peer tools in a subprocess.

    The peer script reports the best of 3 `generate` calls on one prompt, and llama-cpp-python keeps
    that prompt's KV cache between calls, so its figure leaves the prompt out (a run of +1 token takes
    ~2 ms, far less than evaluating 64 prompt tokens). The decode rate is therefore taken from two of
    its runs, +1 and +`new_tokens`: (new_tokens - 1) / (t_new - t_1). It has no end-to-end figure."""
    gguf = folder / "model-f32.gguf"

    def run(cmd: list[str]) -> Optional[str]:
        """The command's stdout, or None (reported) if it fails."""
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            console.print(f"[yellow]llama.cpp: {' '.join(cmd)} failed: {exc}[/]")
            return None
        if done.returncode != 0:
            console.print(f"[yellow]llama.cpp: {' '.join(cmd)} exited {done.returncode}:[/]\n{done.stderr[-2000:]}")
            return None
        return done.stdout

    if run([python, str(tools / "hf_mixtral_to_gguf.py"), str(folder), str(gguf)]) is None:
        return None
    seconds = []
    for new in (1, new_tokens):
        output = run([python, str(tools / "time_llama_cpp.py"), str(gguf), "--prompt", str(prompt_len),
                      "--new", str(new), "--threads", str(threads)])
        match = None if output is None else re.search(r"\+(\d+): ([\d.]+) tok/s", output)
        if match is None:
            if output is not None:
                console.print(f"[yellow]llama.cpp: no tok/s figure in its output:[/]\n{output}")
            return None
        seconds.append(int(match.group(1)) / float(match.group(2)))  # the time of its best run
    step = (seconds[1] - seconds[0]) / (new_tokens - 1)
    if step <= 0:
        console.print(f"[yellow]llama.cpp: +{new_tokens} tokens took no longer than +1 ({seconds}); no figure[/]")
        return None
    console.print(f"  llama.cpp: +1 token {1e3 * seconds[0]:.1f} ms, +{new_tokens} {1e3 * seconds[1]:.1f} ms "
                  f"(best of 3 each, prompt cached)")
    return Figure("llama.cpp", 1, 1.0 / step, None, 1e3 * step, None, 3)


def report(figures: list[Figure], match: dict[int, float], console: Console) -> dict[str, Any]:
    """Print the table and the ratios the issue's targets are stated in; return them as a dict."""
    table = Table(title="greedy decode, fp32, CPU (best of repeats)")
    for col in ("system", "batch", "decode tok/s", "end-to-end tok/s", "decode ms/step", "prefill ms"):
        table.add_column(col, justify="right" if col != "system" else "left")
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for f in figures:
        table.add_row(f.system, str(f.batch), fmt(f.decode_tok_s, ".0f"), fmt(f.end_to_end_tok_s, ".0f"),
                      fmt(f.decode_ms_per_step, ".2f"), fmt(f.prefill_ms, ".1f"))
    console.print(table)
    by = {(f.system, f.batch): f for f in figures}
    ratios: dict[str, float] = {}
    for b in sorted({f.batch for f in figures if f.system == "moescope"}):
        eng, hf = by[("moescope", b)], by.get(("transformers", b))
        if hf is not None:
            ratios[f"decode_vs_transformers_b{b}"] = eng.decode_tok_s / hf.decode_tok_s
            ratios[f"end_to_end_vs_transformers_b{b}"] = eng.end_to_end_tok_s / hf.end_to_end_tok_s
    if ("llama.cpp", 1) in by and ("moescope", 1) in by:
        ratios["decode_vs_llama_cpp_b1"] = by[("moescope", 1)].decode_tok_s / by[("llama.cpp", 1)].decode_tok_s
    for name, value in ratios.items():
        console.print(f"  {name}: {value:.2f}x")
    for b, frac in match.items():
        console.print(f"  batch {b}: engine greedy tokens equal to transformers' for {100 * frac:.1f}% of positions")
    return ratios


def report_ceiling(cfg: Any, batch: int, figures: list[Figure], console: Console) -> "Ceiling":
    """Measure the kernel ceilings of `cfg`'s decode steps here and print them next to the figures."""
    from engine.bench.kernel_ceiling import measure

    c = measure(cfg, batch)
    by = {(f.system, f.batch): f for f in figures}
    rates = ", ".join(f"{rows} row{'s' if rows > 1 else ''} {gbps:.1f}" for rows, gbps in c.xla_gbps_by_rows.items())
    console.print(f"  memory read (torch sum): {c.torch_read_gbps_one_thread:.1f} GB/s on one thread, "
                  f"{c.torch_read_gbps_all_threads:.1f} GB/s on all; XLA streams expert weights at {rates} GB/s")
    line = (f"  batch 1: a step reads {c.b1_bytes / 1e6:.1f} MB -> at least {c.b1_floor_ms:.2f} ms/step "
            "through XLA's dots")
    for system in ("moescope", "llama.cpp"):
        if (system, 1) in by:
            line += f"; {system} {by[(system, 1)].decode_ms_per_step:.2f}"
    console.print(line)
    line = (f"  batch {batch}: the experts alone ({c.batch_rows} rows per call) take at least "
            f"{c.batch_expert_floor_ms:.2f} ms/step")
    if ("transformers", batch) in by:
        budget = by[("transformers", batch)].decode_ms_per_step / 3
        line += f"; 3x transformers allows {budget:.2f} ms for the whole step"
    console.print(line)
    return c


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, help="HF Mixtral folder (default: a random 29M init in a temp dir)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--torch-threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--llama-python", help="a Python with llama-cpp-python and gguf installed (separate venv)")
    ap.add_argument("--llama-tools", type=Path, help="folder with hf_mixtral_to_gguf.py and time_llama_cpp.py")
    ap.add_argument("--llama-threads", type=int, default=2)
    ap.add_argument("--llama-timeout", type=float, default=900.0)
    ap.add_argument("--ceiling", action="store_true", help="also measure what XLA:CPU's dot kernels allow a step "
                    "here (engine/bench/kernel_ceiling.py) and set the figures against it")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    if (args.llama_python is None) != (args.llama_tools is None):
        ap.error("--llama-python and --llama-tools go together")
    if args.new < 2:
        ap.error("--new must be at least 2 (decode needs a step after prefill)")
    console = Console()
    with tempfile.TemporaryDirectory(prefix="bench_decode_") as tmp:
        folder = args.checkpoint or write_random_checkpoint(Path(tmp) / "ckpt", args.seed)
        console.print(f"checkpoint {folder}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        engine = EngineRunner(folder)
        hf = TransformersRunner(folder, args.torch_threads)
        figures: list[Figure] = []
        match: dict[int, float] = {}
        for b in args.batches:
            eng, ref, match[b] = bench_batch(engine, hf, b, args.prompt, args.new, args.repeats, args.seed + b, console)
            figures += [eng, ref]
        if args.llama_python:
            work = Path(tmp) / "llama"
            work.mkdir()
            for name in os.listdir(folder):
                os.symlink(Path(folder).resolve() / name, work / name)
            llama = llama_cpp_figure(args.llama_python, args.llama_tools.resolve(), work, args.prompt, args.new,
                                     args.llama_threads, args.llama_timeout, console)
            if llama is not None:
                figures.append(llama)
        ceiling = report_ceiling(engine.cfg, max(args.batches), figures, console) if args.ceiling else None
        console.print(f"load average at the end {os.getloadavg()[0]:.1f}")
        ratios = report(figures, match, console)
    result = {"figures": [asdict(f) for f in figures], "ratios": ratios, "greedy_match": match,
              "prompt": args.prompt, "new_tokens": args.new, "command": " ".join(sys.argv),
              "ceiling": None if ceiling is None else asdict(ceiling)}
    if args.json:
        from core.telemetry import atomic_write_text

        atomic_write_text(args.json, json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
