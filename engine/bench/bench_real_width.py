"""Real-width bf16 MoE checkpoints served by moescope, transformers and llama.cpp, side by side.

    python -m engine.bench.bench_real_width                                   # mixtral, qwen3_moe, deepseek_v2
    python -m engine.bench.bench_real_width --families deepseek_v2_27 --skip moescope
    python -m engine.bench.bench_real_width --families mixtral --layers mixtral=1 --batches 1 --new 8

For each family a random-weight checkpoint at the released model's hidden and expert widths, cut in
depth to a few GB (engine/bench/real_width.py), is built once under `--root` (default runs/real_width,
reused while complete). Every system then runs in its own subprocess, one after the other, so peak
memory is per system:

  moescope in-memory   python -m models.generate ... dtype=bfloat16 (one run per batch size)
  moescope offloaded   python -m engine.run ... offload.budget_fraction=F (per budget and batch size)
  transformers         engine/bench/peers/hf_peer.py, bf16, torch threads = all cores (both batch sizes)
  llama.cpp            engine/bench/peers/llama_peer.py under `--llama-python`, a BF16 GGUF written by
                       engine/bench/peers/to_gguf.py, every CPU as torch and XLA use (both batch sizes)

and one table per family gives load time (each system starts with its weight files in the page cache: the
bench reads them first, so a system does not load from what the previous one left there), peak anonymous
memory and peak RSS over the checkpoint's bytes, decode tokens/s at each batch size with its ratio to
transformers, and "others busy": the CPUs
other processes (and kernel writeback) kept busy on average during the system's worst run, measured
from /proc/stat. Ratios matter more than absolute times on this shared machine, and a figure taken
while others were busy is not comparable (on 2 cores a third busy process slows torch and XLA
several-fold). The machine's memory read rate is measured right before and after every run ("read
GB/s"): on this VM it moves up to 2x with where the host places the vCPUs, which a b1 decode (one read
of the weights a step) follows, so "b1 x llama per read" compares b1 rates each divided by its own read
rate. Every system runs `--rounds` times, the order reversed every other round, and keeps its best run;
the peers also take the best of `--repeats` runs inside each round. Where llama.cpp runs, moescope in
memory and llama.cpp are also compared in ONE process (engine/bench/peers/interleaved.py: `--bursts`
alternated decode bursts per batch size, median ratio of decode speeds), which the read rate's drift
between separate runs cannot bias; that line is the one to quote against llama.cpp. Decode tok/s counts the `--new`
single-token steps after the prefill (moescope's runs are asked for `--new + 1` tokens: the prefill's
token plus `--new` steps). llama.cpp maps its GGUF by default, so its weights count in RSS, not in
anonymous memory. Before timing llama.cpp, its logits on a 16-token prompt are checked against
transformers' on the same weights (max |diff|, greedy agreement; `--check-f32` adds a float32
reference). A system that fails or times out is reported with the last line of its stderr and the
bench goes on. llama.cpp does not load DeepSeek-V2-Lite cut in depth (see `llama_support`); the
`deepseek_v2_27` preset keeps all 27 layers with 8 experts each so that it can be compared too.
Everything is written under `--root`: checkpoints in ckpt/, GGUF files in gguf/ (both reused), each
run's logs and JSON in results/<time>/ with the tables in summary.json.

Per weight type (`--types bf16,q8_0,q4_k_m`, `--types-only` for just this): the bf16 GGUF is quantized by
llama.cpp's own quantizer (peers/llama_quantize.py: its Q8_0 / Q4_K_M presets, every tensor), and moescope
(`model.checkpoint=<file.gguf>`: experts in their blocks, memory-mapped; dense weights dequantized to bf16) and
llama.cpp run on that SAME file, decode bursts alternated in one process per batch size (median and quartiles
over the bursts). transformers runs bf16 only (see TRANSFORMERS_QUANT).

    python -m engine.bench.bench_real_width --families mixtral_e4 --types bf16,q8_0,q4_k_m --types-only \
        --llama-python /work/llama-venv/bin/python --bursts 12
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from engine.bench.real_width import (COMPLETE_MARKER, PRESETS, cached_checkpoint, checkpoint_bytes, describe,
                                     real_width_config, write_speed)
from engine.bench.peers.common import prompt_ids
from engine.bench.bench_cpu_experts import ReadProbe
from models import native
from models.config import Family, ModelConfig
from models.memory import cpu_count, host_memory

REPO = Path(__file__).resolve().parents[2]
DEFAULT_FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v2")
SYSTEMS = ("moescope-mem", "moescope-off", "transformers", "llama.cpp")


# ---- which systems can run what -------------------------------------------------------------------


def llama_support(cfg: ModelConfig) -> tuple[bool, str]:
    """Whether engine/bench/peers/to_gguf.py + the bundled llama.cpp run `cfg` (and why not)."""
    if cfg.family is Family.mixtral:
        return True, ""
    if cfg.family is Family.qwen3_moe:
        if not cfg.norm_topk_prob:
            return False, "llama.cpp's qwen3moe always renormalises top-k weights (norm_topk_prob=false)"
        if len(cfg.moe_layers) != cfg.num_hidden_layers:
            return False, "qwen3moe with dense layers is not converted"
        return True, ""
    if cfg.family is Family.deepseek_v2:
        if cfg.q_lora_rank is None and cfg.num_hidden_layers != 27:
            return False, (f"llama.cpp (llama-cpp-python 0.3.16) tells DeepSeek-V2-Lite (no q-LoRA) from V2 by "
                           f"n_layer == 27 and asks this {cfg.num_hidden_layers}-layer model for q_lora_rank / "
                           f"attn_q_a; see --families deepseek_v2_27")
        return True, ""
    return False, f"{cfg.family.value}: no GGUF conversion here"


# ---- subprocesses -------------------------------------------------------------------------------------


@dataclass
class Outcome:
    ok: bool
    seconds: float
    error: str = ""
    data: dict = field(default_factory=dict)
    others_cores: Optional[float] = None  # CPUs other processes kept busy on average meanwhile
    read_gb_s: Optional[float] = None  # the machine's memory read rate around the run (mean of before and after)


def _cpu_seconds() -> tuple[float, float]:
    """(CPU seconds all CPUs spent busy (steal included), CPU seconds of this process and its waited-for children)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    busy = (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return busy, me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def warm_page_cache(weights: Path) -> None:
    """Reads every file of `weights` (a folder or a file) once, when they fit in the available memory."""
    files = sorted(weights.glob("*.safetensors")) if weights.is_dir() else [weights]
    avail = host_memory()[1]
    if avail is not None and sum(f.stat().st_size for f in files) > 0.8 * avail:
        return
    buf = bytearray(64 << 20)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def last_line(path: Path) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    # skip gdb/backtrace noise that llama.cpp's abort handler prints
    useful = [ln for ln in lines if not ln.startswith(("#", "[Inferior", "[New LWP", "warning:"))]
    return (useful or lines or [""])[-1][:300]


def run_logged(cmd: list[str], log: Path, timeout: float, env: Optional[dict] = None, cwd: Path = REPO) -> Outcome:
    log.parent.mkdir(parents=True, exist_ok=True)
    err = log.with_suffix(".err")
    t = time.perf_counter()
    busy0, ours0 = _cpu_seconds()
    with open(log, "w") as out, open(err, "w") as errf:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        try:
            rc = subprocess.run(cmd, stdout=out, stderr=errf, cwd=cwd, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return Outcome(False, time.perf_counter() - t, f"timed out after {timeout:.0f} s")
    dt = time.perf_counter() - t
    busy1, ours1 = _cpu_seconds()
    others = max(0.0, (busy1 - busy0) - (ours1 - ours0)) / max(dt, 1e-9)
    if rc != 0:
        return Outcome(False, dt, f"exit {rc}: {last_line(err) or last_line(log)}", others_cores=others)
    return Outcome(True, dt, others_cores=others)


# ---- one family ------------------------------------------------------------------------------------


@dataclass
class Row:
    system: str
    load_s: Optional[float] = None
    peak_anon: Optional[int] = None
    peak_rss: Optional[int] = None
    tok_s: dict = field(default_factory=dict)  # batch -> tok/s
    errors: list = field(default_factory=list)
    note: str = ""
    others_cores: Optional[float] = None  # the most CPUs other processes used, on average, during one of its runs
    read_gb_s: dict = field(default_factory=dict)  # batch -> memory read rate around the run that gave tok_s

    def merge_others(self, value: Optional[float]) -> None:
        if value is not None:
            self.others_cores = max(self.others_cores or 0.0, value)

    def take(self, B: int, tok_s: Optional[float], read: Optional[float]) -> None:
        """Keeps the better of this batch size's runs (over rounds), with the read rate measured around it."""
        if tok_s is not None and tok_s > self.tok_s.get(B, -1.0):
            self.tok_s[B], self.read_gb_s[B] = tok_s, read

    def merge(self, other: "Row") -> None:
        """Folds another round's row of the same system into this one."""
        for B, v in other.tok_s.items():
            self.take(B, v, other.read_gb_s.get(B))
        if other.load_s is not None:
            self.load_s = min(self.load_s if self.load_s is not None else math.inf, other.load_s)
        self.merge_peak(other.peak_anon, other.peak_rss)
        self.merge_others(other.others_cores)
        self.errors += other.errors
        self.note = self.note or other.note

    def merge_peak(self, anon: Optional[int], rss: Optional[int]) -> None:
        if anon is not None:
            self.peak_anon = max(self.peak_anon or 0, int(anon))
        if rss is not None:
            self.peak_rss = max(self.peak_rss or 0, int(rss))


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.a = args
        self.root = Path(args.root).resolve()
        self.out = self.root / "results" / time.strftime("%Y-%m-%d_%H-%M-%S")
        self.out.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "WANDB_MODE": "disabled", "WANDB_SILENT": "true",
                    "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        self.summary: dict[str, Any] = {"args": vars(args), "families": {}}
        self.probe = ReadProbe() if native.available() else None

    def timed(self, cmd: list[str], log: Path, weights: Optional[Path] = None) -> Outcome:
        """run_logged, with the memory read rate measured right before and after (all cores); `weights` (a
        checkpoint folder or a GGUF file) are read through the page cache first, so that every system loads
        from a warm cache and not from whatever the previous system left there."""
        if weights is not None:
            warm_page_cache(weights)
        before = self.probe.read_now(0) if self.probe else None
        res = run_logged(cmd, log, self.a.timeout, self.env)
        if self.probe:
            res.read_gb_s = (before + self.probe.read_now(0)) / 2
        return res

    def skipped(self, system: str) -> bool:
        return any(system == s or system.startswith(s) for s in self.a.skip)

    # -- moescope (entry points writing results.json) --
    def moescope(self, fam: str, ckpt: Path, budget: Optional[float], B: int) -> Outcome:
        label = "mem" if budget is None else f"off{budget:g}"
        run_dir = self.out / fam / f"moescope-{label}-b{B}"
        if run_dir.exists():
            shutil.rmtree(run_dir)
        common = [f"model.checkpoint={ckpt}", "model.arch=null", "model.name=rw", "dtype=bfloat16",
                  "wandb.mode=disabled", f"hydra.run.dir={run_dir}"]
        n = self.a.new + 1  # the prefill's token + `new` decode steps, as the peers count
        if budget is None:
            cmd = [sys.executable, "-m", "models.generate", *common, f"batch_size={B}",  # every token, as the peers
                   f"prompt_len={self.a.prompt}", f"max_new_tokens={n}", "stop_at_eos=false"]
        else:
            cmd = [sys.executable, "-m", "engine.run", *common, "compare_in_memory=false",
                   f"offload.budget_fraction={budget}", f"workload.batch_size={B}",
                   f"workload.prompt_len={self.a.prompt}", f"workload.gen_len={n}", "workload.num_batches=1"]
        res = self.timed(cmd, self.out / fam / f"moescope-{label}-b{B}.log", ckpt)
        path = run_dir / "results.json"
        if res.ok:
            if not path.is_file():
                return Outcome(False, res.seconds, f"no results.json in {run_dir}")
            res.data = json.loads(path.read_text())
        return res

    def moescope_row(self, fam: str, ckpt: Path, budget: Optional[float]) -> Row:
        row = Row("moescope in-memory" if budget is None else f"moescope offload {budget:g}")
        for B in self.a.batches:
            res = self.moescope(fam, ckpt, budget, B)
            row.merge_others(res.others_cores)
            if not res.ok:
                row.errors.append(f"b{B}: {res.error}")
                print(f"    {row.system} b{B}: FAILED ({res.error})", flush=True)
                continue
            d = res.data
            tok = d["decode_tokens_per_s"]  # both entry points report it
            row.take(B, tok, res.read_gb_s)
            if row.load_s is None:
                row.load_s = float(d["load_s"])
            row.merge_peak(d.get("peak_anon_bytes"), d.get("peak_rss_bytes"))
            print(f"    {row.system} b{B}: {fmt(tok, '.2f')} tok/s, load {fmt(row.load_s, '.1f')} s "
                  f"({res.seconds:.0f} s; memory read {fmt(res.read_gb_s, '.1f')} GB/s; other processes busy "
                  f"{res.others_cores:.2f} CPUs)", flush=True)
        return row

    # -- peers --
    def peer_row(self, name: str, cmd: list[str], result: Path, log: Path, weights: Optional[Path] = None) -> Row:
        row = Row(name)
        if result.exists():
            result.unlink()
        res = self.timed(cmd, log, weights)
        row.merge_others(res.others_cores)
        if not res.ok or not result.is_file():
            row.errors.append(res.error or f"no {result}")
            print(f"    {name}: FAILED ({row.errors[-1]})", flush=True)
            return row
        d = json.loads(result.read_text())
        row.load_s = d.get("load_s")
        row.merge_peak(d.get("peak_anon_bytes"), d.get("peak_rss_bytes"))
        for B, v in d.get("batches", {}).items():
            row.take(int(B), v.get("decode_tok_s"), res.read_gb_s)
        print(f"    {name}: load {fmt(row.load_s, '.1f')} s, "
              + ", ".join(f"b{B} {fmt(v, '.2f')} tok/s" for B, v in sorted(row.tok_s.items()))
              + f" ({res.seconds:.0f} s; memory read {fmt(res.read_gb_s, '.1f')} GB/s; other processes busy "
                f"{res.others_cores:.2f} CPUs)", flush=True)
        return row

    def gguf(self, fam: str, ckpt: Path) -> tuple[Optional[Path], str]:
        dst = self.root / "gguf" / f"{ckpt.name}.gguf"
        marker = ckpt / COMPLETE_MARKER
        if dst.is_file() and dst.stat().st_mtime > marker.stat().st_mtime:
            return dst, ""
        dst.parent.mkdir(parents=True, exist_ok=True)
        res = run_logged([self.a.llama_python, "-m", "engine.bench.peers.to_gguf", str(ckpt), str(dst)],
                         self.out / fam / "to_gguf.log", self.a.timeout, self.env)
        if not res.ok:
            return None, res.error
        size = dst.stat().st_size
        os.sync()  # no writeback of the new file competing with the timed runs
        print(f"    GGUF {dst.name}: {size / 1e9:.2f} GB in {res.seconds:.1f} s", flush=True)
        return dst, ""

    def check_logits(self, fam: str, ckpt: Path, gguf: Path, vocab: int) -> dict:
        """transformers (bf16) vs llama.cpp logits of one 16-token prompt on the same weights."""
        import numpy as np

        d = self.out / fam
        ids = [int(x) for x in prompt_ids(1, 16, vocab, seed=7)[0]]
        (d / "check_ids.json").write_text(json.dumps(ids))
        out = {}
        runs = {"transformers": [sys.executable, "-m", "engine.bench.peers.hf_peer", str(ckpt)],
                "llama.cpp": [self.a.llama_python, "-m", "engine.bench.peers.llama_peer", str(gguf),
                              "--threads", str(self.a.llama_threads)]}
        if self.a.check_f32:
            runs["transformers-f32"] = runs["transformers"] + ["--dtype", "float32"]
        for name, cmd in runs.items():
            npy = d / f"logits-{name}.npy"
            res = run_logged(cmd + ["--logits", str(d / "check_ids.json"), "--logits-out", str(npy)],
                             d / f"logits-{name}.log", self.a.timeout, self.env)
            if not res.ok:
                return {"error": f"{name}: {res.error}"}
            out[name] = np.load(npy)
        hf, ll = out["transformers"], out["llama.cpp"]
        top = np.sort(hf, -1)
        agree = hf.argmax(-1) == ll.argmax(-1)
        report = {"positions": len(ids), "max_abs_diff": float(np.abs(hf - ll).max()),
                  "mean_abs_diff": float(np.abs(hf - ll).mean()), "logit_std": float(hf.std()),
                  "logit_max_abs": float(np.abs(hf).max()), "argmax_agree": int(agree.sum()),
                  "hf_top2_margin_where_disagree": [float(m) for m in (top[:, -1] - top[:, -2])[~agree]]}
        if "transformers-f32" in out:
            ref = out["transformers-f32"]
            report.update(llama_vs_f32_max_abs=float(np.abs(ll - ref).max()),
                          hf_bf16_vs_f32_max_abs=float(np.abs(hf - ref).max()),
                          llama_argmax_agree_f32=int((ll.argmax(-1) == ref.argmax(-1)).sum()),
                          hf_bf16_argmax_agree_f32=int((hf.argmax(-1) == ref.argmax(-1)).sum()))
        return report

    def systems(self, fam: str, cfg: ModelConfig, ckpt: Path, info: dict) -> list[tuple[str, Callable[[], Row]]]:
        """The timed systems of one family, each as (name, a callable that runs it once and returns its row);
        GGUF conversion and the logits check happen here, once."""
        fam_dir = self.out / fam
        jobs: list[tuple[str, Callable[[], Row]]] = []
        if not self.skipped("transformers"):
            cmd = [sys.executable, "-m", "engine.bench.peers.hf_peer", str(ckpt), "--batch", *map(str, self.a.batches),
                   "--prompt", str(self.a.prompt), "--new", str(self.a.new), "--repeats", str(self.a.repeats),
                   "--out", str(fam_dir / "transformers.json")]
            jobs.append(("transformers bf16", lambda: self.peer_row("transformers bf16", cmd, fam_dir / "transformers.json",
                                                                    fam_dir / "transformers.log", ckpt)))
        if not self.skipped("llama.cpp"):
            jobs.append(("llama.cpp bf16", self.llama_job(fam, cfg, ckpt, info)))
        if not self.skipped("moescope-mem"):
            jobs.append(("moescope in-memory", lambda: self.moescope_row(fam, ckpt, None)))
        if not self.skipped("moescope-off"):
            for budget in self.a.budgets:
                jobs.append((f"moescope offload {budget:g}", lambda b=budget: self.moescope_row(fam, ckpt, b)))
        return jobs

    def llama_job(self, fam: str, cfg: ModelConfig, ckpt: Path, info: dict) -> Callable[[], Row]:
        ok, why = llama_support(cfg)
        if not ok:
            print(f"    llama.cpp: n/a ({why})", flush=True)
            return lambda: Row("llama.cpp bf16", note=why)
        gguf, err = self.gguf(fam, ckpt)
        if gguf is None:
            return lambda: Row("llama.cpp bf16", errors=[f"GGUF: {err}"])
        if not self.skipped("check"):
            info["llama_check"] = self.check_logits(fam, ckpt, gguf, cfg.vocab_size)
            print(f"    llama.cpp vs transformers logits: {check_line(info['llama_check'])}", flush=True)
        info["gguf_bytes"] = gguf.stat().st_size
        if not self.skipped("interleaved"):
            info["interleaved"] = self.interleaved(fam, ckpt, gguf)
        fam_dir = self.out / fam
        mmap = [] if self.a.llama_mmap else ["--no-mmap"]
        cmd = [self.a.llama_python, "-m", "engine.bench.peers.llama_peer", str(gguf), "--batch",
               *map(str, self.a.batches), "--prompt", str(self.a.prompt), "--new", str(self.a.new),
               "--threads", str(self.a.llama_threads), *mmap, "--repeats", str(self.a.repeats),
               "--out", str(fam_dir / "llama.json")]
        return lambda: self.peer_row("llama.cpp bf16", cmd, fam_dir / "llama.json", fam_dir / "llama.log", gguf)

    def interleaved(self, fam: str, ckpt: Path, gguf: Path, tag: str = "") -> dict:
        """moescope in memory and llama.cpp in one process, decode bursts alternated (peers/interleaved.py), per
        batch size: the comparison that the read rate's drift between separate runs cannot bias. `ckpt` is what
        moescope loads: the HF folder, or the GGUF file itself (then both map one file: its bytes count once, plus
        moescope's dense weights dequantized)."""
        if ckpt == gguf:
            need = gguf.stat().st_size + dense_bytes(self.current_cfg)
        else:
            need = 2 * checkpoint_bytes(ckpt)  # both copies of the weights in one process
        avail = host_memory()[1]
        if avail is not None and need > 0.9 * avail:
            return {"error": f"needs {need / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB available"}
        site = subprocess.run([self.a.llama_python, "-c", "import llama_cpp, os; "
                               "print(os.path.dirname(os.path.dirname(llama_cpp.__file__)))"],
                              capture_output=True, text=True).stdout.strip()
        out: dict[str, Any] = {}
        for B in self.a.batches:
            result = self.out / fam / f"interleaved{'-' + tag if tag else ''}-b{B}.json"
            res = self.timed([sys.executable, "-m", "engine.bench.peers.interleaved", str(ckpt), str(gguf),
                              "--llama-site", site, "--batch", str(B), "--prompt", str(self.a.prompt), "--new",
                              str(self.a.new), "--bursts", str(self.a.bursts), "--threads", str(self.a.llama_threads),
                              "--out", str(result)], result.with_suffix(".log"))
            out[str(B)] = json.loads(result.read_text()) if res.ok and result.is_file() else {"error": res.error}
            print(f"    interleaved{' ' + tag if tag else ''} b{B}: {interleaved_line(out[str(B)])}", flush=True)
        return out

    # -- per weight type, on one GGUF file each (`--types`) --
    def typed_gguf(self, fam: str, ckpt: Path, qtype: str) -> tuple[Optional[Path], str]:
        """The family's GGUF in `qtype`: the bf16 one (to_gguf.py), or that file quantized by llama.cpp's own
        quantizer (peers/llama_quantize.py), reused while newer than its source."""
        src, err = self.gguf(fam, ckpt)
        if src is None or qtype == "bf16":
            return src, err
        dst = src.with_name(f"{src.stem}-{qtype}.gguf")
        if dst.is_file() and dst.stat().st_mtime > src.stat().st_mtime:
            return dst, ""
        res = run_logged([self.a.llama_python, "-m", "engine.bench.peers.llama_quantize", str(src), str(dst), qtype],
                         self.out / fam / f"quantize-{qtype}.log", self.a.timeout, self.env)
        if not res.ok:
            return None, res.error
        os.sync()
        print(f"    GGUF {dst.name}: {dst.stat().st_size / 1e9:.2f} GB ({qtype}, llama.cpp's quantizer, "
              f"{res.seconds:.1f} s)", flush=True)
        return dst, ""

    def types_section(self, fam: str, cfg: ModelConfig, ckpt: Path) -> dict:
        """Per `--types` weight type: moescope (`model.checkpoint=<file.gguf>`) and llama.cpp on the SAME GGUF file,
        decode bursts alternated in one process (peers/interleaved.py) at every batch size; transformers only where
        it runs the type (bf16: the safetensors checkpoint holding the same weights)."""
        out: dict[str, Any] = {}
        ok, why = llama_support(cfg)
        for qtype in self.a.types:
            entry: dict[str, Any] = out.setdefault(qtype, {})
            if not ok or self.skipped("llama.cpp"):
                entry["error"] = why or "llama.cpp skipped"
                continue
            gguf, err = self.typed_gguf(fam, ckpt, qtype)
            if gguf is None:
                entry["error"] = f"GGUF: {err}"
                print(f"    {qtype}: FAILED ({entry['error']})", flush=True)
                continue
            entry["gguf"], entry["gguf_bytes"] = str(gguf), gguf.stat().st_size
            entry["interleaved"] = self.interleaved(fam, gguf, gguf, tag=qtype)
            if qtype != "bf16":
                entry["transformers"] = TRANSFORMERS_QUANT
            elif not self.skipped("transformers"):
                result = self.out / fam / "transformers-types.json"
                cmd = [sys.executable, "-m", "engine.bench.peers.hf_peer", str(ckpt), "--batch",
                       *map(str, self.a.batches), "--prompt", str(self.a.prompt), "--new", str(self.a.new),
                       "--repeats", str(self.a.repeats), "--out", str(result)]
                row = self.peer_row("transformers bf16", cmd, result, self.out / fam / "transformers-types.log", ckpt)
                entry["transformers"] = {str(B): v for B, v in row.tok_s.items()} or {"error": "; ".join(row.errors)}
        return out

    def run_rounds(self, jobs: list[tuple[str, Callable[[], Row]]]) -> list[Row]:
        """Every system `--rounds` times, the order reversed every other round (what the host's placement of
        the vCPUs does to the read rate then falls on each system alike); each row keeps its best run."""
        rows: dict[str, Row] = {}
        for r in range(self.a.rounds):
            if self.a.rounds > 1:
                print(f"    -- round {r + 1} of {self.a.rounds}", flush=True)
            for name, job in (jobs if r % 2 == 0 else jobs[::-1]):
                row = job()
                if name in rows:
                    rows[name].merge(row)
                else:
                    rows[name] = row
        return [rows[name] for name, _ in jobs]

    def family(self, fam: str) -> dict:
        layers = self.a.layers.get(fam)
        cfg = real_width_config(fam, layers)
        self.current_cfg = cfg
        name = f"{fam}-L{cfg.num_hidden_layers}-{self.a.layout}"
        print(f"\n== {fam}: {describe(cfg)}", flush=True)
        t = time.perf_counter()
        ckpt = cached_checkpoint(name, cfg, self.root / "ckpt", layout=self.a.layout, verbose=True)
        size = checkpoint_bytes(ckpt)
        os.sync()  # no writeback of a new checkpoint competing with the timed runs
        print(f"    checkpoint {ckpt} ({size / 1e9:.2f} GB, {time.perf_counter() - t:.1f} s; written at "
              f"{fmt(write_speed(ckpt), '.2f')} GB/s)", flush=True)
        fam_dir = self.out / fam
        fam_dir.mkdir(parents=True, exist_ok=True)
        info: dict[str, Any] = {"config": describe(cfg), "checkpoint": str(ckpt), "checkpoint_bytes": size,
                                "write_gb_s": write_speed(ckpt)}
        tables = []
        if self.a.types:
            info["types"] = self.types_section(fam, cfg, ckpt)
            tables.append(render_types(fam, cfg, info["types"], self.a.batches))
        if not self.a.types_only:
            rows = self.run_rounds(self.systems(fam, cfg, ckpt, info))
            info["rows"] = [vars(r) for r in rows]
            tables.insert(0, render(fam, cfg, size, rows, self.a.batches, info))
        table = "\n\n".join(tables)
        info["table"] = table
        print("\n" + table, flush=True)
        self.summary["families"][fam] = info
        (self.out / "summary.json").write_text(json.dumps(self.summary, indent=2, default=str) + "\n")
        return info


# ---- output ----------------------------------------------------------------------------------------------


def fmt(v: Optional[float], spec: str) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def interleaved_line(r: dict) -> str:
    if "error" in r:
        return f"FAILED ({r['error']})"
    return (f"moescope / llama.cpp decode speed, same process, {r['bursts']} alternated bursts: median "
            f"{r['moescope_over_llama_median']:.2f} (quartiles {r['moescope_over_llama_q1']:.2f}-"
            f"{r['moescope_over_llama_q3']:.2f}; moescope faster in {r['bursts_moescope_faster']})")


def check_line(c: dict) -> str:
    if "error" in c:
        return f"FAILED ({c['error']})"
    s = (f"max |diff| {c['max_abs_diff']:.3f} (mean {c['mean_abs_diff']:.4f}) at logit std {c['logit_std']:.2f}, "
         f"greedy agreement {c['argmax_agree']}/{c['positions']}")
    if c["hf_top2_margin_where_disagree"]:
        s += " (disagreements where transformers' top-2 margin is " + \
             ", ".join(f"{m:.3f}" for m in c["hf_top2_margin_where_disagree"]) + ")"
    if "llama_vs_f32_max_abs" in c:
        s += (f"; vs transformers fp32: llama.cpp {c['llama_vs_f32_max_abs']:.3f}, transformers bf16 "
              f"{c['hf_bf16_vs_f32_max_abs']:.3f}")
    return s


TRANSFORMERS_QUANT = ("n/a: transformers reads a GGUF file (`from_pretrained(..., gguf_file=)`) by dequantizing every "
                      "tensor to float, so it never runs the blocks (its speed is its bf16 speed, the bf16 row); its "
                      "int8/int4 backends (bitsandbytes, torchao) quantize in their own layouts, not ggml's")


def dense_bytes(cfg: ModelConfig) -> int:
    """bf16 bytes of everything but the routed experts (what moescope dequantizes from a GGUF file)."""
    from schedulers.cost import non_expert_params

    return 2 * non_expert_params(cfg)


def quartiles(r: dict, key: str) -> str:
    """`median (q1-q3)` of a per-burst series in an interleaved result."""
    import numpy as np

    v = np.asarray(r[key], dtype=float)
    return f"{np.median(v):.2f} ({np.percentile(v, 25):.2f}-{np.percentile(v, 75):.2f})"


def render_types(fam: str, cfg: ModelConfig, types: dict, batches: list[int]) -> str:
    """Per weight type: the GGUF file, and per batch moescope's and llama.cpp's decode tok/s (median and quartiles
    over the alternated bursts) with the burst-by-burst ratio."""
    head = ["type", "GGUF GB"] + [c for B in batches for c in (f"b{B} moescope tok/s", f"b{B} llama.cpp tok/s",
                                                                f"b{B} moescope / llama.cpp")]
    lines = []
    notes = []
    for qtype, e in types.items():
        if "error" in e:
            notes.append(f"  {qtype}: {e['error']}")
            continue
        cells = [qtype, f"{e['gguf_bytes'] / 1e9:.2f}"]
        for B in batches:
            r = e["interleaved"].get(str(B), {"error": "not run"})
            if "error" in r:
                cells += ["FAILED", "", r["error"][:60]]
                continue
            ours = [B * 1e3 / ms for ms in r["moescope_ms_per_step"]]
            theirs = [B * 1e3 / ms for ms in r["llama_ms_per_step"]]
            cells += [quartiles({"v": ours}, "v"), quartiles({"v": theirs}, "v"),
                      f"{r['moescope_over_llama_median']:.2f} ({r['moescope_over_llama_q1']:.2f}-"
                      f"{r['moescope_over_llama_q3']:.2f}), faster in {r['bursts_moescope_faster']}/{r['bursts']}"]
        lines.append(cells)
        hf = e.get("transformers")
        if isinstance(hf, str):
            notes.append(f"  transformers {qtype}: {hf}")
        elif isinstance(hf, dict):
            notes.append(f"  transformers {qtype} (safetensors, same weights, its own process): "
                         + ", ".join(f"b{B} {v:.2f} tok/s" if isinstance(v, float) else f"{B}: {v}"
                                     for B, v in hf.items()))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)] if lines else [len(h) for h in head]
    out = [f"[{fam}] per weight type, moescope and llama.cpp on the same GGUF file, alternated bursts in one process "
           f"(median (quartiles) over the bursts); {describe(cfg)}",
           "  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(cells, widths)) for cells in lines]
    return "\n".join(out + notes)


def ratio(v: Optional[float], base: Optional[float]) -> Optional[float]:
    return v / base if v and base else None


def render(fam: str, cfg: ModelConfig, size: int, rows: list[Row], batches: list[int], info: dict) -> str:
    hf = next((r for r in rows if r.system.startswith("transformers")), Row(""))
    ll = next((r for r in rows if r.system.startswith("llama.cpp")), Row(""))
    head = ["system", "load s", "anon/ckpt", "rss/ckpt"] + [f"tok/s b{B}" for B in batches] + \
           [f"b{B} x HF" for B in batches] + [f"b{B} x llama" for B in batches] + \
           ["read GB/s", "b1 x llama per read", "others busy"]
    lines = []
    for r in rows:
        cells = [r.system, fmt(r.load_s, ".1f"), fmt(r.peak_anon / size if r.peak_anon else None, ".2f"),
                 fmt(r.peak_rss / size if r.peak_rss else None, ".2f")]
        cells += [fmt(r.tok_s.get(B), ".2f") for B in batches]
        cells += [fmt(ratio(r.tok_s.get(B), hf.tok_s.get(B)), ".2f") for B in batches]
        cells += [fmt(ratio(r.tok_s.get(B), ll.tok_s.get(B)), ".2f") for B in batches]
        reads = sorted(v for v in r.read_gb_s.values() if v)
        cells.append(f"{reads[0]:.0f}-{reads[-1]:.0f}" if reads else "n/a")
        # b1 decode reads the weights once a step: tok/s per GB/s of read rate is comparable across moments
        cells.append(fmt(ratio(ratio(r.tok_s.get(1), r.read_gb_s.get(1)), ratio(ll.tok_s.get(1), ll.read_gb_s.get(1))),
                         ".2f"))
        cells.append(fmt(r.others_cores, ".2f"))
        lines.append(cells)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    out = [f"[{fam}] {describe(cfg)}; checkpoint {size / 1e9:.2f} GB bf16",
           "  ".join(h.ljust(w) for h, w in zip(head, widths)),
           "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(cells, widths)) for cells in lines]
    for r in rows:
        if r.note:
            out.append(f"  {r.system}: n/a: {r.note}")
        for e in r.errors:
            out.append(f"  {r.system}: {e}")
    if "llama_check" in info:
        out.append(f"  llama.cpp vs transformers logits: {check_line(info['llama_check'])}")
    for B, r in info.get("interleaved", {}).items():
        out.append(f"  b{B}, {interleaved_line(r)}")
    out.append("  read GB/s: the machine's memory read rate (all cores) measured around each system's runs; it moves "
               "up to 2x with where the host places the vCPUs, so 'b1 x llama per read' divides each b1 rate by "
               "the read rate measured with it")
    busy = max((r.others_cores or 0.0) for r in rows) if rows else 0.0
    if busy > 0.25:
        out.append(f"  others busy: CPUs other processes used on average during a system's worst run; up to "
                   f"{busy:.2f} of {os.cpu_count()} here, so those figures are slowed by contention")
    return "\n".join(out)


def parse_layers(text: Optional[str], families: list[str]) -> dict[str, int]:
    if not text:
        return {}
    if text.isdigit():
        return {f: int(text) for f in families}
    out = {}
    for part in text.split(","):
        k, _, v = part.partition("=")
        if k not in PRESETS or not v.isdigit():
            raise SystemExit(f"--layers: expected FAMILY=N[,FAMILY=N] or N, got {part!r}")
        out[k] = int(v)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--families", default=",".join(DEFAULT_FAMILIES),
                    help=f"comma-separated, of {sorted(PRESETS)}")
    ap.add_argument("--layers", help="decoder layers: N for all, or FAMILY=N,... (default: each preset's)")
    ap.add_argument("--layout", choices=("per_expert", "fused"), default="per_expert")
    ap.add_argument("--root", default=str(REPO / "runs" / "real_width"))
    ap.add_argument("--llama-python", default="/tmp/llamavenv/bin/python")
    ap.add_argument("--llama-threads", type=int, default=cpu_count(),
                    help="llama.cpp threads (default: every CPU this process may use, as torch and XLA take)")
    ap.add_argument("--llama-mmap", action=argparse.BooleanOptionalAction, default=True,
                    help="llama.cpp maps the GGUF (its default); --no-llama-mmap reads it into anonymous memory")
    ap.add_argument("--skip", default="", help="comma-separated: transformers, llama.cpp, check, interleaved, "
                                               "moescope (or moescope-mem, moescope-off)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--budgets", default="0.25,1.0", help="moescope offload budget fractions")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=16, help="decode steps timed after the prefill")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each peer (best reported); moescope's "
                                                           "entry points time one run after their warm-up")
    ap.add_argument("--rounds", type=int, default=2, help="runs of every system, alternating their order; each "
                                                          "row keeps its best")
    ap.add_argument("--bursts", type=int, default=16, help="alternated decode bursts of the same-process "
                                                           "moescope / llama.cpp comparison")
    ap.add_argument("--types", default="", help="weight types of the per-type section, e.g. bf16,q8_0,q4_k_m: "
                                                "moescope and llama.cpp on the same GGUF file of each (empty: none)")
    ap.add_argument("--types-only", action="store_true", help="run only the per-type section")
    ap.add_argument("--check-f32", action="store_true",
                    help="also compare both with transformers in fp32 (twice the checkpoint in memory)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per subprocess")
    a = ap.parse_args(argv)
    families = [f for f in a.families.split(",") if f]
    for f in families:
        if f not in PRESETS:
            raise SystemExit(f"--families: unknown {f!r}; known: {sorted(PRESETS)}")
    a.layers = parse_layers(a.layers, families)
    a.skip = [s for s in a.skip.split(",") if s]
    a.batches = [int(b) for b in a.batches.split(",") if b]
    a.budgets = [float(b) for b in a.budgets.split(",") if b]
    a.types = [t for t in a.types.split(",") if t]
    from engine.bench.peers.llama_quantize import FTYPES

    bad = [t for t in a.types if t != "bf16" and t not in FTYPES]
    if bad:
        raise SystemExit(f"--types: unknown {bad}; known: bf16, {', '.join(sorted(FTYPES))}")
    if a.types_only and not a.types:
        raise SystemExit("--types-only: name the types (--types bf16,q8_0,q4_k_m)")
    if "llama.cpp" not in a.skip and not Path(a.llama_python).exists():
        print(f"no {a.llama_python}: skipping llama.cpp", flush=True)
        a.skip.append("llama.cpp")
    bench = Bench(a)
    print(f"results in {bench.out}", flush=True)
    for fam in families:
        bench.family(fam)
    print("\n\n" + "\n\n".join(info["table"] for info in bench.summary["families"].values()))
    print(f"\nsummary: {bench.out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
