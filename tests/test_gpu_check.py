"""`python -m engine.bench.gpu_check` in its tiny-width mode on the CPU backend (issue 29, item 6): every stage of
the GPU check runs here end to end, so it cannot rot before a GPU runs it."""

from __future__ import annotations

import json
from pathlib import Path

from conf import compose
from engine.bench.gpu_check import check, default_policy, summary_table


def test_gpu_check_fast_mode_runs_every_stage_on_the_cpu_backend(tmp_path: Path) -> None:
    res = check(fast=True, layers=1, batch=2, prompt_len=16, gen_len=4, repeats=2, deadline_s=500, out=tmp_path)
    assert json.loads((tmp_path / "results.json").read_text())["policies"].keys() == res["policies"].keys()
    assert res["device"]["platform"] == "cpu" and res["device"]["pinned_host"] is False  # the CPU backend: no DMA
    assert not (tmp_path / "checkpoints").exists() and res["skipped"] == {}
    link = res["link"]
    assert link["h2d_gbps"] > 0 and link["link_profile"] == "local_cpu"
    assert abs(link["share_of_peak"] - link["h2d_gbps"] / link["link_peak_gbps"]) < 1e-9 and link["table2_band"] == [0.66, 0.8]
    assert res["profile_used"] == "calibrated" and (tmp_path / "gpu_check_profile.yaml").is_file()
    # the default policy is whatever conf/run.yaml serves (make run), compared with PreSched and HybriMoE
    default = default_policy()
    assert res["default_policy"] == default and list(res["policies"]) == list(dict.fromkeys([default, "presched",
                                                                                              "hybrimoe"]))
    assert res["policies"][default]["scheduler"] == compose("run", []).scheduler.label
    for name, row in res["policies"].items():
        assert row["tokens_match_in_memory"] is True and row["throughput_tok_s"] > 0, name
        assert 0 < row["planning_ms"]["decode"]["median_ms"] <= row["planning_ms"]["decode"]["p99_ms"]
        assert row["simulated"]["over_measured"] > 0 and row["simulated"]["routing"] == "synthetic"
    assert res["policies"][default]["vs_default"] == 1.0 and res["tokens_match_in_memory"] is True
    table = summary_table(res)
    assert all(name in table for name in res["policies"]) and "Table 2: 66-80 %" in table


def test_a_stage_past_the_deadline_is_interrupted_and_later_ones_are_not_started() -> None:
    import time

    from engine.bench.gpu_check import Deadline

    clock = Deadline(1.0)
    started = time.monotonic()
    assert clock.stage("hangs", lambda: time.sleep(30)) is None and time.monotonic() - started < 5
    assert clock.stage("next", lambda: 1) is None
    assert clock.skipped == {"hangs": "interrupted at the deadline", "next": clock.skipped["next"]}
    assert clock.skipped["next"].startswith("not started")
