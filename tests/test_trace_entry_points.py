"""Real logs everywhere a trace is read, and no entry point building a model that cannot fit (issue 29, item 7):
`predictors.train` reads a vLLM log as `engine.simulate` does (drop_incomplete, decode-only phase) and needs no model
for routing-only methods; a model larger than the host is a one-line error before anything is allocated."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from conf import compose
from core.telemetry import Telemetry
from core.trace import DECODE
from models.loading import load_model, model_bytes, resolve_model_config
from models.memory import anon_bytes, host_memory


def incomplete_log(path: Path, seqs: int = 12, tokens: int = 6, layers: int = 4, experts: int = 8,
                   missing: tuple = ((3, 2, 1), (5, 0, 3))) -> Path:
    """A decode-only vLLM-style log (tiny_mixtral's 4 MoE layers, 8 experts top-2) where the tokens (seq, token) of
    `missing` lack one layer's line, as a log cut mid-step has."""
    rng = np.random.default_rng(5)
    lines = [json.dumps({"type": "meta", "model_id": "log-model"})]
    for s in range(seqs):
        for t in range(tokens):
            for layer in range(layers):
                if (s, t, layer) in missing:
                    continue
                lines.append(json.dumps({"request_id": f"r{s}", "token_idx": t, "layer": layer,
                                         "topk_ids": [int(x) for x in rng.choice(experts, 2, replace=False)],
                                         "topk_weights": [0.7, 0.3]}))
    path.write_text("\n".join(lines) + "\n")
    return path


HUGE = "model.arch.intermediate_size=14336000"  # Mixtral-8x7B with 1000x wider experts: ~170 TiB, more than any host


def train(tmp_path: Path, name: str, overrides: list[str]) -> dict:
    from predictors.train import run

    node = compose("predictors_train", ["plots=false", "checkpoint_every=0", "online=false", "wandb.mode=disabled",
                                        *overrides])
    with Telemetry(node, task="predictors_train", run_dir=tmp_path / name) as tm:
        return run(OmegaConf.to_object(node), tm)


def test_predictors_train_reads_an_incomplete_decode_only_log_as_the_simulator_does(tmp_path: Path) -> None:
    log = incomplete_log(tmp_path / "cut.jsonl")
    base = ["model=tiny_mixtral", f"trace={log}", "predictor=transition"]
    with pytest.raises(ValueError, match=r"cut\.jsonl:\d+: sequence 'r3' token 2 has no routing for layer\(s\) \[1\] "
                                         r"\(2 incomplete tokens; drop_incomplete=true drops them\)$"):
        train(tmp_path, "strict", base)
    res = train(tmp_path, "dropped", [*base, "drop_incomplete=true", "phase=decode"])
    assert res["data"]["rows"] == 12 * 6 - 2  # the two cut tokens dropped, every other one kept
    assert res["methods"]["transition"]["test"]["groups"]["all"]["hit"] > 0
    # shift=true by default, yet no shifted set is recorded: that would build the model routing-only methods never need
    assert res["data"]["shift_rows"] == 0 and "need no model" in res["shift_skipped"]
    assert not (tmp_path / "dropped" / "shift_trace.npz").exists()
    from core.trace_import import LogPhase, load_trace_file
    trace = load_trace_file(log, drop_incomplete=True, phase=LogPhase.decode)
    assert (trace.phase == DECODE).all()  # what phase=decode hands the trainer: every token one decode step


def test_routing_only_training_on_a_log_never_builds_mixtral_8x7b(tmp_path: Path) -> None:
    """The issue's command (OOM-killed before: it recorded a shifted trace with the 47B-parameter model)."""
    log = incomplete_log(tmp_path / "mixtral.jsonl", layers=32, seqs=6, tokens=4, missing=())
    before = anon_bytes() or 0
    res = train(tmp_path, "big", ["model=mixtral_8x7b", f"trace={log}", "predictor=transition", "baselines={}"])
    assert res["model"]["name"] == "mixtral-8x7b" and res["shift_skipped"]
    assert (anon_bytes() or 0) - before < 2 * 2**30  # nothing near the model's 87 GiB of bf16 weights


def test_a_model_larger_than_the_host_is_a_one_line_error_before_any_allocation() -> None:
    node = compose("predictors_train", ["model=mixtral_8x7b", HUGE])
    need = model_bytes(resolve_model_config(node.model), np.float32)
    assert need > 50 * 2**40 and need > (host_memory()[1] or 0)
    before = anon_bytes() or 0
    with pytest.raises(MemoryError, match=r"^model=mixtral-8x7b \(random weights, float32\) needs \d+\.\d GiB of host "
                                          r"memory, this machine has \d+\.\d GiB available; [^\n]+$"):
        load_model(node.model)
    assert (anon_bytes() or 0) - before < 2**30


@pytest.mark.slow
def test_the_entry_point_ends_with_the_memory_error_in_one_line(tmp_path: Path) -> None:
    """`python -m engine.record model=<too big>`: exit status 2 and one line naming the model, in seconds."""
    proc = subprocess.run([sys.executable, "-m", "engine.record", "model=mixtral_8x7b",
                           HUGE, "wandb.mode=disabled", f"hydra.run.dir={tmp_path}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "GiB of host memory" in line]
    assert len(errors) == 1 and "model=mixtral-8x7b" in errors[0], proc.stderr[-2000:]
