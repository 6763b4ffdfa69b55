"""Schema of `python -m predictors.train`: train expert predictors on routing traces and evaluate them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from omegaconf import MISSING

from core.config import store
from core.trace_import import LogPhase, TraceFileFormat
from core.telemetry import WandbConfig
from models.loading import DType, ModelSpec
from predictors.config import PredictorConfig
from engine.workloads.config import WorkloadConfig


@dataclass
class PredictorsTrainConfig:
    model: ModelSpec = MISSING
    workload: WorkloadConfig = MISSING  # in-distribution traffic: training and test sequences
    shift_workload: WorkloadConfig = MISSING  # a second, shifted test set (code prompts)
    predictor: PredictorConfig = MISSING  # the headline predictor (trained first; online fine-tuning is streamed)
    baselines: Dict[str, PredictorConfig] = field(default_factory=dict)  # compared with it (conf/predictor/*)
    trace: Optional[str] = None  # an in-distribution routing trace with hidden states; None: record `workload`
    shift_trace: Optional[str] = None  # the shifted trace; None: record `shift_workload` (not with a `trace` file
    #   and routing-only methods: the shifted set is then skipped, since recording it would need the model)
    trace_format: TraceFileFormat = TraceFileFormat.auto  # of `trace` / `shift_trace`: by suffix, npz, vllm_jsonl
    drop_incomplete: bool = False  # vLLM logs: drop tokens missing some layer (default: fail naming the line)
    phase: LogPhase = LogPhase.auto  # vLLM logs: auto (a sequence's first pass is its prefill) | decode (decode-only)
    shift: bool = True  # evaluate on the shifted set
    save_traces: bool = True  # write recorded traces into the run folder (trace.npz, shift_trace.npz)
    test_fraction: float = 0.25  # share of in-distribution sequences held out for test
    val_fraction: float = 0.1  # share of the remaining sequences for validation (MoEless profiling)
    split_seed: int = 0
    distances: List[int] = field(default_factory=lambda: [1, 2, 3, 4])  # gate and MoEless at each distance
    online: bool = True  # stream both test sets through the headline predictor with online fine-tuning
    hot_n: int = 4  # "hot Top-n within true Top-(n + slack)" (LayerScope Table 4)
    hot_slack: int = 2
    out: Optional[str] = None  # folder of the trained predictor folders; default <run dir>/predictors
    checkpoint_every: int = 5  # epochs between mid-training checkpoints of each learned layer (and its end); 0: none
    keep_checkpoints: int = 2  # newest checkpoints kept per learned layer
    resume: Optional[str] = None  # an interrupted run's folder (or its checkpoints/); true: this run's own folder
    plots: bool = True
    dtype: DType = DType.auto  # of the model that records traces
    seed: int = 0
    wandb: WandbConfig = field(default_factory=WandbConfig)


store(PredictorsTrainConfig, name="base_predictors_train")
