"""`python -m engine.simulate` (single run and Hydra multirun) and `python -m engine.report` end to end."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

from engine.report import main as report_main

SMALL = ["model=deepseek_v2_lite", "batch_size=2", "prompt_len=16", "gen_len=3", "timeline.max_layers=4"]


def run(args: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "engine.simulate", *args], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_single_run_writes_results_timeline_and_offline_wandb(tmp_path: Path) -> None:
    run([*SMALL, f"hydra.run.dir={tmp_path}", "wandb.mode=offline"])
    res = json.loads((tmp_path / "results.json").read_text())
    # the default is Horizon: two batches of batch_size in flight, one token per sequence per step
    assert res["scheduler"] == "Horizon" and res["hardware"] == "v100_pcie3"
    assert res["tokens_generated"] == 2 * 2 * 3
    assert res["throughput_tok_s"] == res["tokens_generated"] / res["total_s"]
    assert 0 < res["lower_bound_s"] <= res["total_s"]
    assert len(res["per_layer_decode"]["layer_ms"]) == 26
    assert (tmp_path / "timeline.png").stat().st_size > 1000
    assert list((tmp_path / "wandb").glob("offline-run-*"))


def test_bad_scheduler_key_names_it(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "engine.simulate", *SMALL, f"hydra.run.dir={tmp_path}",
                           "scheduler.kind=magic", "wandb.mode=disabled"], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode != 0 and "scheduler.kind" in proc.stderr


def test_multirun_then_report(tmp_path: Path) -> None:
    run(["-m", *SMALL, "scheduler=presched,fiddler", "wandb.mode=disabled", "timeline.plot=false",
         f"hydra.sweep.dir={tmp_path}"])
    assert len(list(tmp_path.rglob("results.json"))) == 2
    report_main([str(tmp_path)])
    md = (tmp_path / "report.md").read_text()
    assert "## deepseek-v2-lite on v100_pcie3" in md and "LayerScope throughput gain" in md
    assert "| Fiddler |" in md
    assert "Routing: synthetic (load CV 0." in md  # which routing the figures used, with its measured statistics
    with open(tmp_path / "runs.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert {r["scheduler"] for r in rows} == {"LayerScope", "Fiddler"}
    assert (tmp_path / "fig11_throughput.png").exists() and (tmp_path / "fig12_decode_latency.png").exists()


def test_report_sets_sweeps_beside_the_published_points_calibration_uses() -> None:
    """The report's "Beside the paper" figures are the calibration's published points (one data file), under
    the names and labels simulated runs report."""
    from engine.calibrate_paper import load_points
    from engine.report import PUBLISHED, paper_points

    rows = paper_points()
    comparable = [p for p in load_points(PUBLISHED) if p.evaluate and p.kind != "bound" and p.metric != "t_io_ms"]
    assert len(rows) == len(comparable) > 30
    assert ("§5.3, a100_pcie4 b64", "mixtral-8x7b", "a100_pcie4", 64, "ablation", "LayerScope w/o PreSched",
            0.541) in rows
    assert ("§5.2.2, v100_pcie3 b4", "deepseek-v2-lite", "v100_pcie3", 4, "latency_cut", "Fiddler", 0.723) in rows
