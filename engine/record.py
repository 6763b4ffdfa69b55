"""`python -m engine.record`: routing traces (and gate inputs) of a model serving a text workload.

    python -m engine.record model=mixtral_tiny workload=sharegpt
    python -m engine.record model=deepseek_tiny workload=code workload.num_batches=4 out=/tmp/code.npz

Every batch is generated greedily with the in-memory model (`models.generation.Generator` with
routing capture); prefill and decode steps go into one `core.trace.RoutingTrace` file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from core.config import resolve_path
from conf import hydra_task
from conf.schemas.record import RecordConfig
from engine.recording import record_generation, trace_meta
from core.telemetry import Telemetry
from core.trace import RoutingTrace, TraceRecorder
from core.trace_import import LogPhase, TraceFileFormat, load_trace_file
from engine.workloads import PromptSampler, build_workload
from models.generation import Generator
from models.loading import load_model, load_tokenizer


def record_trace(model_node: Any, workload_node: Any, keep_hidden: bool = True, dtype: Any = "auto",
                 seed: int = 0, progress: Any = None) -> RoutingTrace:
    """Serve every batch of a prompt workload with the in-memory model and return its routing trace."""
    cfg, model, folder = load_model(model_node, dtype=dtype, seed=seed)
    tokenizer = load_tokenizer(folder)
    if tokenizer is None:
        raise ValueError(f"model {model_node.name}: no tokenizer.json next to the checkpoint; "
                         "text workloads need a trained model (e.g. model=mixtral_tiny)")
    sampler = build_workload(workload_node, tokenizer, separator_id=cfg.eos_token_id)
    if not isinstance(sampler, PromptSampler):
        raise ValueError(f"workload.kind={workload_node.kind}: record serves prompt workloads (sharegpt, code)")
    source = f"{workload_node.name} seed={workload_node.seed}"
    recorder = TraceRecorder(trace_meta(cfg, str(model_node.name), source), keep_hidden=keep_hidden)
    generator = Generator(model, capture=True, capture_hidden=keep_hidden)
    batches = list(sampler.batches(workload_node.num_batches))
    next_seq = 0
    for batch in (progress(batches, "record") if progress else batches):
        prompts = batch.token_lists()
        out = generator.generate(prompts, batch.gen_len, pad_token_id=cfg.pad_token_id)
        record_generation(recorder, out, prompts, seq_ids=range(next_seq, next_seq + len(prompts)))
        next_seq += len(prompts)
    return recorder.build()


def obtain_trace(path: Optional[str], model: Any, workload: Any, *, fmt: TraceFileFormat = TraceFileFormat.auto,
                 num_experts: Optional[int] = None, drop_incomplete: bool = False, keep_hidden: bool = True,
                 dtype: Any = "auto", seed: int = 0, progress: Any = None, phase: LogPhase = LogPhase.auto,
                 drop_key: str = "drop_incomplete") -> RoutingTrace:
    """The routing trace a task works on: the file at `path` (a .npz trace, or a vLLM .jsonl log read with
    `num_experts` / `drop_incomplete` / `phase`, `drop_key` naming the task's key), or without one a recording of `model` serving the prompt `workload`.

    `model`: a `ModelSpec` (or its node), `workload`: a `WorkloadConfig` (or its node)."""
    if path:
        return load_trace_file(resolve_path(path), fmt, num_experts, drop_incomplete, phase=phase, drop_key=drop_key)
    return record_trace(model, workload, keep_hidden=keep_hidden, dtype=dtype, seed=seed, progress=progress)


@hydra_task("record")
def main(node: DictConfig, tm: Telemetry) -> dict[str, Any]:
    cfg: RecordConfig = OmegaConf.to_object(node)  # type: ignore[assignment]
    trace = record_trace(cfg.model, cfg.workload, cfg.keep_hidden, cfg.dtype.value, cfg.seed, tm.progress)
    path = trace.save(resolve_path(cfg.out) if cfg.out else tm.run_dir / "trace.npz")
    return {"trace": str(path), "rows": trace.num_rows, "steps": trace.num_steps,
            "moe_layers": trace.num_layers, "sequences": int(len(set(trace.seq.tolist()))),
            "hidden": trace.hidden is not None, "bytes": Path(path).stat().st_size}


if __name__ == "__main__":
    main()
