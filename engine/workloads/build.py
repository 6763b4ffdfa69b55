"""From a `workload` config node to the objects that produce batches."""

from __future__ import annotations

from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from core.config import resolve_path
from engine.workloads.config import AzureWorkloadConfig, PromptSource, WorkloadConfig, WorkloadKind
from engine.workloads.azure import AzureTrace, load_azure_trace
from core.texts import SHAREGPT_PATH, TextPrompt, Tokenizer
from engine.workloads.prompts import PromptSampler
from engine.workloads.replay import TraceReplay
from core.sharegpt import load_sharegpt
from core.stdlib_texts import code_prompts


def workload_config(node: Any) -> WorkloadConfig:
    """The typed `WorkloadConfig` of a config node (DictConfig or already a WorkloadConfig)."""
    if isinstance(node, DictConfig):
        return OmegaConf.to_object(node)  # type: ignore[return-value]
    return node


def load_prompts(source: PromptSource | WorkloadKind, path: Optional[str] = None,
                 code_max_chars: int = 2000) -> list[TextPrompt]:
    """Text prompts of a source: ShareGPT (a file, the shipped one by default) or Python code chunks."""
    if source.value == "sharegpt":
        return load_sharegpt(resolve_path(path) if path else SHAREGPT_PATH)
    if source.value == "code":
        return code_prompts(max_chars=code_max_chars)
    raise ValueError(f"workload: {source.value!r} is not a text prompt source")


def azure_trace(cfg: AzureWorkloadConfig, seed: int = 0) -> AzureTrace:
    """The configured slice of an Azure trace: window, thinning, time scale, clipping (in that order)."""
    trace = load_azure_trace(resolve_path(cfg.path) if cfg.path else cfg.service.value)
    if cfg.peak:
        if cfg.duration_s is None:
            raise ValueError("workload.azure.peak: needs workload.azure.duration_s")
        trace = trace.window(trace.busiest_window(cfg.duration_s), cfg.duration_s)
    elif cfg.start_s or cfg.duration_s is not None:
        duration = cfg.duration_s if cfg.duration_s is not None else max(trace.duration_s - cfg.start_s, 0) + 1e-9
        trace = trace.window(cfg.start_s, duration)
    trace = trace.thinned(cfg.request_fraction, seed)
    if cfg.time_scale != 1.0:
        trace = trace.time_scaled(cfg.time_scale)
    return trace.clipped(cfg.max_context_tokens, cfg.max_generated_tokens)


def build_workload(node: Any, tokenizer: Tokenizer, separator_id: Optional[int] = None
                   ) -> PromptSampler | TraceReplay:
    """A `PromptSampler` (sharegpt, code) or a `TraceReplay` (azure) for a workload config.

    `separator_id` (usually the tokenizer's EOS id) goes between prompts joined into one sequence.
    """
    cfg = workload_config(node)
    if cfg.kind is WorkloadKind.azure:
        prompts = load_prompts(cfg.azure.prompts, cfg.path, cfg.code_max_chars)
        return TraceReplay(azure_trace(cfg.azure, cfg.seed), prompts, tokenizer, interval_s=cfg.azure.interval_s,
                           seed=cfg.seed, separator_id=separator_id)
    prompts = load_prompts(cfg.kind, cfg.path, cfg.code_max_chars)
    return PromptSampler(prompts, tokenizer, batch_size=cfg.batch_size, prompt_len=cfg.prompt_len,
                         gen_len=cfg.gen_len, policy=cfg.length_policy, seed=cfg.seed,
                         min_prompt_tokens=cfg.min_prompt_tokens, separator_id=separator_id)
