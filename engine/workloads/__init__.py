"""Workloads: what is served. Text prompt batches (ShareGPT, Python code) and Azure trace replay.

Public API (import from `engine.workloads`):

- `load_sharegpt(path=None) -> list[TextPrompt]`: the shipped 500 ShareGPT prompts (or a file).
- `code_prompts(max_chars=2000) -> list[TextPrompt]`: Python standard-library source chunks.
- `PromptSampler(prompts, tokenizer, batch_size=, prompt_len=, gen_len=, policy=LengthPolicy.*,
  seed=)`: `.batches(n)` yields deterministic `PromptBatch`es (token ids per prompt, `gen_len`,
  `pad_to`); `in_flight(batches, n)` joins them n at a time (a policy keeping n batches in flight).
- `load_azure_trace("conv" | "code" | path) -> AzureTrace`: arrivals (s), context and generated
  tokens per request; `.window(start, dur)`, `.busiest_window(dur)`, `.thinned(frac, seed)`,
  `.time_scaled(f)`, `.clipped(max_ctx, max_gen)`, `.per_interval(1.0) -> RequestBatches`
  (per-second batches as MoEless §6.1: `.counts`, `.context_tokens`, `.generated_tokens`, iterate
  for `RequestBatch`es), `.summary()`.
- `TraceReplay(trace, prompts, tokenizer, interval_s=1.0, seed=)`: per-interval `ReplayBatch`es
  whose requests carry real prompt tokens of exactly the trace's context length.
- `build_workload(cfg.workload, tokenizer, separator_id)`: the object a `workload` config names.
- `WorkloadFormatError`: malformed files (message names file and line).
"""

from engine.workloads.azure import AzureTrace, RequestBatch, RequestBatches, load_azure_trace
from core.texts import TextPrompt, WorkloadFormatError, encode_ids
from engine.workloads.build import azure_trace, build_workload, load_prompts
from engine.workloads.prompts import LengthPolicy, PromptBatch, PromptSampler, TokenStream, in_flight
from engine.workloads.replay import ReplayBatch, TraceReplay
from core.sharegpt import load_sharegpt
from core.stdlib_texts import code_prompts, pydoc_topics, stdlib_docstrings, stdlib_fingerprint

__all__ = ["AzureTrace", "RequestBatch", "RequestBatches", "load_azure_trace", "TextPrompt", "WorkloadFormatError",
           "encode_ids", "azure_trace", "build_workload", "load_prompts", "LengthPolicy", "PromptBatch",
           "PromptSampler", "in_flight", "TokenStream", "ReplayBatch", "TraceReplay", "load_sharegpt", "code_prompts",
           "pydoc_topics", "stdlib_docstrings", "stdlib_fingerprint"]
