"""`python -m engine.run`, the README's main job, as a user runs it: offloaded inference on the shipped
model with a Hydra override or two, results.json, the timeline figure, wandb offline files."""

from __future__ import annotations

import json
from pathlib import Path

from tests.test_generate_entry import run_entry


def test_main_job_serves_offloaded_with_the_in_memory_tokens(tmp_path: Path) -> None:
    proc = run_entry("engine.run", f"hydra.run.dir={tmp_path}", "workload.batch_size=2", "workload.num_batches=1",
                     "workload.prompt_len=16", "workload.gen_len=6")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((tmp_path / "results.json").read_text())
    assert r["model"] == "mixtral-tiny" and r["scheduler"] == "Horizon" and r["predictor"] == "gate"
    # the picture is a decode pass after the first, as long as the decode latency the results report
    drawn = r["timeline"]["decode"]
    assert drawn["step"] >= 2 and drawn["span_ms"] <= drawn["wall_ms"] * 1.01
    assert 0.3 <= drawn["span_ms"] / r["decode_latency_ms"] <= 1.5, (drawn, r["decode_latency_ms"])
    assert r["timeline"]["prefill"]["wall_ms"] == 1e3 * r["prefill_s"] and (tmp_path / "timeline_prefill.png").is_file()
    assert r["tokens_match_in_memory"] is True
    assert r["generated_tokens"] == 2 * 6 and r["throughput_tok_s"] > 0 and r["decode_latency_ms"] > 0
    assert 0 < r["cache_slots"] < r["experts_total"] == 64  # a quarter of the experts by default
    # wall-clock headline figures and the MoE layers' own times are named apart
    assert "decode_latency_s" not in r and 0 < r["moe_layers_decode_latency_s"] * 1e3 <= r["decode_latency_ms"]
    assert len(r["text"]) == 2 and all(isinstance(t, str) for t in r["text"])
    assert (tmp_path / "timeline.png").is_file()
    assert list((tmp_path / "wandb").glob("offline-run-*")), "no offline wandb run written"
    # issue 29 item 4: the policy's plan call per MoE layer, and where a decode layer's wall time goes
    plan = r["planning_ms"]["decode"]
    assert plan["layers"] == 5 * 8  # 5 decode passes x 8 MoE layers of the one measured batch
    assert 0 < plan["median_ms"] <= plan["p99_ms"] < 50 and r["plan_median_ms_decode"] == plan["median_ms"]
    # of it, what stood on the critical path (device idle at the plan's end), and the layers planned behind the device
    assert 0 <= r["plan_exposed_mean_ms_decode"] == plan["exposed_mean_ms"] <= plan["mean_ms"]
    assert 0 <= plan["behind_device_share"] <= 1
    parts = r["decode_layer_breakdown"]
    assert abs(sum(parts["per_layer_ms"].values()) - parts["layer_ms"]) < 1e-6 * parts["layer_ms"] + 1e-9
    assert 0 < parts["per_layer_ms"]["plan"] <= parts["executor_own_ms"] < parts["layer_ms"]
    # the laps cover the MoE layers: their sum is the decode passes' MoE time, short of each pass's wall time
    assert parts["layer_ms"] * 8 <= r["decode_latency_ms"] * 1.05
    assert parts["layer_ms"] * 8 >= r["moe_layers_decode_latency_s"] * 1e3 * 0.5
    # issue 28 item 6: the anonymous memory at each phase's end and what the measured batches added; the cache's bytes
    assert all(r[f"anon_{k}_bytes"] > 0 for k in ("after_load", "after_profile", "after_warm_up", "after_serving"))
    assert r["anon_growth_serving_bytes"] == r["anon_after_serving_bytes"] - r["anon_after_warm_up_bytes"]
    assert r["expert_cache_held_bytes"] == r["expert_cache_bytes"] > 0  # float slots: as budgeted


def test_main_job_names_a_bad_override(tmp_path: Path) -> None:
    proc = run_entry("engine.run", f"hydra.run.dir={tmp_path}", "scheduler=no_such_policy")
    assert proc.returncode != 0 and "no_such_policy" in proc.stderr
    assert not (tmp_path / "results.json").exists()


def test_the_oracle_predictor_without_the_in_memory_model_is_named(tmp_path: Path) -> None:
    proc = run_entry("engine.run", f"hydra.run.dir={tmp_path}", "predictor=oracle", "compare_in_memory=false",
                     "workload.batch_size=2", "workload.num_batches=1", "workload.prompt_len=16", "workload.gen_len=2")
    assert proc.returncode != 0 and "predictor=oracle needs the in-memory model" in proc.stderr
    assert not (tmp_path / "results.json").exists()


def test_warm_up_picks_the_first_batch_of_each_compiled_shape() -> None:
    from engine.offload.executor import padded_shapes
    from engine.run import first_of_each_shape
    from engine.workloads.prompts import PromptBatch

    def batch(i: int, lengths: list[int], gen: int = 32) -> PromptBatch:
        return PromptBatch(i, tuple(("p",) for _ in lengths), tuple(tuple(range(1, n + 1)) for n in lengths), gen)

    # prompts padded to 16-token buckets, the KV cache to 64: 100 and 110 tokens share a shape, 120 does not
    # (its bucket is 128); 4 prompts are another batch size; another generation length another cache
    batches = [batch(0, [100, 5]), batch(1, [110, 7]), batch(2, [120, 3]), batch(3, [100, 5, 5, 5]),
               batch(4, [100, 5], gen=100)]
    assert padded_shapes(batches[0].token_lists(), 32) == padded_shapes(batches[1].token_lists(), 32) == (2, 112, 192)
    assert first_of_each_shape(batches) == [0, 2, 3, 4]
    assert first_of_each_shape(batches[1:2] * 3) == [0]
