"""Schema of the `workload` group: text prompt batches (ShareGPT, Python code) or Azure trace replay."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

from omegaconf import MISSING

from core.config import store


class LengthPolicy(enum.Enum):
    """How prompts are fitted to `prompt_len` (the mechanism lives in `engine.workloads.prompts`)."""

    truncate = "truncate"  # first prompt_len tokens of each prompt; shorter prompts stay short (ragged)
    pad = "pad"  # as truncate, and the batch asks to be padded to prompt_len (`PromptBatch.pad_to`)
    pack = "pack"  # sampled prompts joined (separator between) into exactly prompt_len tokens each


class WorkloadKind(enum.Enum):
    sharegpt = "sharegpt"  # ShareGPT first-turn prompts (engine/data/sharegpt)
    code = "code"  # Python standard-library source, cut into chunks (distribution shift)
    azure = "azure"  # Azure LLM trace replay: arrivals and token counts, content from `azure.prompts`


class PromptSource(enum.Enum):
    sharegpt = "sharegpt"
    code = "code"


class AzureService(enum.Enum):
    code = "code"
    conv = "conv"


@dataclass
class AzureWorkloadConfig:
    """Which part of an Azure trace to replay. Applied in this order: window, thinning, time scale, clipping."""

    service: AzureService = AzureService.conv
    path: Optional[str] = None  # a CSV in the same format instead of the shipped one (pkg: allowed)
    start_s: float = 0.0  # window start, seconds after the first request
    duration_s: Optional[float] = None  # window length; None: to the end of the trace
    peak: bool = False  # start at the busiest window of duration_s (MoEless replays the peak) instead
    request_fraction: float = 1.0  # keep a seeded random subset of the requests (rate scaling)
    time_scale: float = 1.0  # multiply arrival times (< 1 compresses: higher request rate)
    max_context_tokens: Optional[int] = None  # cap prompt lengths (models with short context)
    max_generated_tokens: Optional[int] = None
    interval_s: float = 1.0  # requests arriving in one interval form one batch (MoEless: 1 s)
    prompts: PromptSource = PromptSource.sharegpt  # text that fills each request's context tokens


@dataclass
class WorkloadConfig:
    name: str = MISSING
    kind: WorkloadKind = WorkloadKind.sharegpt
    path: Optional[str] = None  # ShareGPT-format prompt file; None: the shipped 500 prompts
    batch_size: int = 8
    num_batches: int = 16
    prompt_len: int = 512  # tokens per prompt at most (truncate, pad) or exactly (pack)
    gen_len: int = 64  # tokens to generate per prompt
    length_policy: LengthPolicy = LengthPolicy.truncate
    min_prompt_tokens: int = 1  # shorter prompts are skipped (truncate, pad)
    code_max_chars: int = 2000  # code workload: characters per source chunk at most
    seed: int = 0
    azure: AzureWorkloadConfig = field(default_factory=AzureWorkloadConfig)


store(WorkloadConfig, name="base_workload", group="workload")
