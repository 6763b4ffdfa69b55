"""Workloads: shipped ShareGPT / Azure files against independent parses, malformed files, samplers, replay."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from conf import compose
from engine.workloads import (AzureTrace, LengthPolicy, PromptSampler, TraceReplay, WorkloadFormatError, build_workload,
                              code_prompts, encode_ids, load_azure_trace, load_sharegpt)
from engine.workloads.azure import parse_timestamp_ns
from core.texts import AZURE_DIR, SHAREGPT_PATH
from core.stdlib_texts import stdlib_root
from models.tokenizer import EOS, train_bpe


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe([p.text for p in load_sharegpt()], vocab_size=1024)


# ---- ShareGPT --------------------------------------------------------------------------------------
def test_sharegpt_matches_plain_json_load() -> None:
    raw = json.loads(SHAREGPT_PATH.read_text())
    prompts = load_sharegpt()
    assert len(prompts) == len(raw) == 500
    assert [p.id for p in prompts] == [r["id"] for r in raw]
    assert [p.text for p in prompts] == [r["conversations"][0]["value"] for r in raw]


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_sharegpt_record_without_human_turn_names_file_and_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "bad.json", '[\n {"id": "a", "conversations": [{"from": "human", "value": "hi"}]},\n'
                                        ' {"id": "b", "conversations": [{"from": "gpt", "value": "x"}]}\n]')
    with pytest.raises(WorkloadFormatError, match=r"bad\.json:3: column 2: record 1: \(id b\) has no human turn"):
        load_sharegpt(path)


def test_sharegpt_invalid_json_names_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "broken.json", '[\n {"id": "a", "conversations": [{"from": "human", "value": "hi"}]},\n'
                                           ' {"id": "b", "conv\n]')
    with pytest.raises(WorkloadFormatError, match=r"broken\.json:3: .*invalid JSON"):
        load_sharegpt(path)


def test_sharegpt_duplicate_ids_rejected(tmp_path: Path) -> None:
    rec = '{"id": "a", "conversations": [{"from": "human", "value": "hi"}]}'
    with pytest.raises(WorkloadFormatError, match="duplicate id 'a'"):
        load_sharegpt(_write(tmp_path, "dup.json", f"[{rec}, {rec}]"))


# ---- Azure traces ----------------------------------------------------------------------------------
@pytest.mark.parametrize("service,rows", [("code", 8819), ("conv", 19366)])
def test_azure_trace_matches_numpy_datetime_parse(service: str, rows: int) -> None:
    with open(AZURE_DIR / f"AzureLLMInferenceTrace_{service}.csv") as fh:
        table = list(csv.DictReader(fh))
    stamps = np.array([r["TIMESTAMP"].replace(" ", "T") for r in table], dtype="datetime64[ns]")
    trace = load_azure_trace(service)
    assert trace.num_requests == rows == len(table)
    assert trace.start_ns == stamps[0].astype(np.int64)
    np.testing.assert_allclose(trace.arrival_s, (stamps - stamps[0]).astype(np.int64) / 1e9, atol=1e-9)
    np.testing.assert_array_equal(trace.context_tokens, [int(r["ContextTokens"]) for r in table])
    np.testing.assert_array_equal(trace.generated_tokens, [int(r["GeneratedTokens"]) for r in table])
    # per-second batches (MoEless §6.1) against a plain bincount of whole seconds since the first request
    seconds = (stamps - stamps[0]).astype(np.int64) // 1_000_000_000
    per = trace.per_interval(1.0)
    np.testing.assert_array_equal(per.counts, np.bincount(seconds))
    np.testing.assert_array_equal(per.context_tokens, np.bincount(seconds, weights=trace.context_tokens))
    np.testing.assert_array_equal(per.generated_tokens, np.bincount(seconds, weights=trace.generated_tokens))
    batch = per[int(np.argmax(per.counts))]
    assert batch.num_requests == per.counts.max()
    assert np.all((batch.arrival_s >= batch.start_s) & (batch.arrival_s < batch.start_s + 1))


def test_timestamp_keeps_100ns_digits() -> None:
    assert parse_timestamp_ns("1970-01-01 00:00:01.9799600") == 1_979_960_000
    assert parse_timestamp_ns("2023-11-16 18:17:03") - parse_timestamp_ns("2023-11-16 18:17:02.5") == 500_000_000
    with pytest.raises(ValueError, match="valid date"):
        parse_timestamp_ns("2023-02-30 00:00:00")


HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


@pytest.mark.parametrize("row,message", [
    ("2023-11-16 18:17:0x.1,10,5", r":3: TIMESTAMP: timestamp"),
    ("2023-11-16 18:17:05.1,ten,5", r":3: ContextTokens: 'ten' is not an integer"),
    ("2023-11-16 18:17:05.1,10", r":3: expected 3 fields, got 2"),
    ("2023-11-16 18:17:05.1,0,5", r":3: ContextTokens: 0 < 1"),
    ("2023-11-16 18:17:05.1,10,-1", r":3: GeneratedTokens: -1 < 0"),
    ("2023-11-16 18:17:01.0,10,5", r":3: TIMESTAMP 2023-11-16 18:17:01.0 goes back in time"),
])
def test_azure_malformed_row_names_file_and_line(tmp_path: Path, row: str, message: str) -> None:
    path = _write(tmp_path, "trace.csv", HEADER + "2023-11-16 18:17:04.0,100,7\n" + row + "\n")
    with pytest.raises(WorkloadFormatError, match=r"trace\.csv" + message):
        load_azure_trace(path)


def test_azure_missing_column_and_empty_file(tmp_path: Path) -> None:
    with pytest.raises(WorkloadFormatError, match=r"x\.csv:1: header lacks columns \['GeneratedTokens'\]"):
        load_azure_trace(_write(tmp_path, "x.csv", "TIMESTAMP,ContextTokens\n2023-11-16 18:17:04.0,100\n"))
    with pytest.raises(WorkloadFormatError, match="no requests"):
        load_azure_trace(_write(tmp_path, "y.csv", HEADER))


def _small_trace(tmp_path: Path) -> AzureTrace:
    rows = ["2023-11-16 00:00:10.0,10,1", "2023-11-16 00:00:10.5,20,2", "2023-11-16 00:00:12.1,30,3",
            "2023-11-16 00:00:12.2,40,4", "2023-11-16 00:00:12.9,50,5", "2023-11-16 00:00:15.0,60,6"]
    return load_azure_trace(_write(tmp_path, "small.csv", HEADER + "\n".join(rows) + "\n"))


def test_per_second_batches_hand_computed(tmp_path: Path) -> None:
    per = _small_trace(tmp_path).per_interval(1.0)
    # arrivals 0.0 0.5 | - | 2.1 2.2 2.9 | - | - | 5.0  -> six one-second intervals, empty ones kept
    assert per.counts.tolist() == [2, 0, 3, 0, 0, 1]
    assert per.context_tokens.tolist() == [30, 0, 120, 0, 0, 60]
    assert per.generated_tokens.tolist() == [3, 0, 12, 0, 0, 6]
    assert [b.index for b in per.nonempty()] == [0, 2, 5]
    assert per[2].request_ids.tolist() == [2, 3, 4]
    assert _small_trace(tmp_path).per_interval(2.0).counts.tolist() == [2, 3, 1]


def test_window_busiest_thin_scale_clip(tmp_path: Path) -> None:
    trace = _small_trace(tmp_path)
    w = trace.window(2.0, 3.0)  # [2, 5): the three requests at 2.1 2.2 2.9
    assert w.request_ids.tolist() == [2, 3, 4]
    np.testing.assert_allclose(w.arrival_s, [0.1, 0.2, 0.9])
    assert w.per_interval(1.0).counts.tolist() == [3, 0, 0]
    assert trace.busiest_window(1.0) == pytest.approx(2.1)
    assert trace.time_scaled(0.5).per_interval(1.0).counts.tolist() == [2, 3, 1]  # 0 .25 | 1.05 1.1 1.45 | 2.5
    assert trace.clipped(max_context=25).context_tokens.tolist() == [10, 20, 25, 25, 25, 25]
    thin = trace.thinned(0.5, seed=3)
    assert thin.num_requests == 3 and np.all(np.diff(thin.arrival_s) >= 0)
    assert thin.request_ids.tolist() == trace.thinned(0.5, seed=3).request_ids.tolist()


def test_busiest_window_beats_every_other_start_on_real_trace() -> None:
    trace = load_azure_trace("code")
    start = trace.busiest_window(60.0)
    best = trace.window(start, 60.0).num_requests
    grid = np.arange(0.0, trace.duration_s, 0.25)
    brute = max(int(np.sum((trace.arrival_s >= s) & (trace.arrival_s < s + 60.0))) for s in grid)
    assert best >= brute


# ---- text prompt samplers ----------------------------------------------------------------------------
def test_sampler_is_deterministic_and_draws_without_replacement(tokenizer) -> None:
    prompts = load_sharegpt()[:40]

    def run(seed: int) -> list:
        s = PromptSampler(prompts, tokenizer, batch_size=8, prompt_len=64, gen_len=16, seed=seed)
        return list(s.batches(10))

    a, b, c = run(0), run(0), run(1)
    assert [x.tokens for x in a] == [x.tokens for x in b]
    assert [x.prompt_ids for x in a] != [x.prompt_ids for x in c]
    first_epoch = [pid for batch in a[:5] for (pid,) in batch.prompt_ids]
    assert sorted(first_epoch) == sorted(p.id for p in prompts)  # 40 prompts = 5 batches, each once
    by_id = {p.id: p.text for p in prompts}
    for batch in a:
        assert batch.gen_len == 16 and batch.pad_to is None
        for (pid,), toks in zip(batch.prompt_ids, batch.tokens):
            assert list(toks) == encode_ids(tokenizer, by_id[pid])[:64]


def test_pack_policy_gives_exact_lengths_of_joined_prompts(tokenizer) -> None:
    prompts = load_sharegpt()[:50]
    eos = tokenizer.token_to_id(EOS)
    s = PromptSampler(prompts, tokenizer, batch_size=4, prompt_len=512, gen_len=64, policy=LengthPolicy.pack,
                      seed=0, separator_id=eos)
    batch = s.next_batch()
    assert batch.lengths.tolist() == [512] * 4 and batch.pad_to == 512
    by_id = {p.id: p.text for p in prompts}
    for pids, toks in zip(batch.prompt_ids, batch.tokens):
        joined: list[int] = []
        for pid in pids:
            joined += ([eos] if joined else []) + encode_ids(tokenizer, by_id[pid])
        assert list(toks) == joined[:512]
        assert len(joined) - len(encode_ids(tokenizer, by_id[pids[-1]])) - 1 < 512  # no prompt wasted


def test_pad_policy_and_bad_sizes(tokenizer) -> None:
    s = PromptSampler(load_sharegpt(), tokenizer, batch_size=2, prompt_len=32, gen_len=8, policy=LengthPolicy.pad,
                      min_prompt_tokens=10)
    batch = s.next_batch()
    assert batch.pad_to == 32 and all(10 <= n <= 32 for n in batch.lengths)
    with pytest.raises(ValueError, match="batch_size"):
        PromptSampler(load_sharegpt(), tokenizer, batch_size=0, prompt_len=32, gen_len=8)


def test_code_prompts_are_real_stdlib_lines() -> None:
    prompts = code_prompts(max_chars=1500, min_chars=300)
    assert len(prompts) > 1000
    assert all(300 <= len(p.text) <= 1500 for p in prompts)
    for p in prompts[:: max(len(prompts) // 25, 1)]:
        rel, line = p.id.rsplit(":", 1)
        lines = (stdlib_root() / rel).read_text(encoding="utf-8").splitlines(keepends=True)
        assert p.text.startswith(lines[int(line) - 1][:1500])
    assert code_prompts(max_chars=1500, min_chars=300)[:50] == prompts[:50]


# ---- trace replay and config-driven construction -----------------------------------------------------
def test_replay_fills_exact_trace_lengths(tokenizer) -> None:
    trace = load_azure_trace("conv").window(600.0, 4.0)
    replay = TraceReplay(trace, load_sharegpt(), tokenizer, seed=5, separator_id=2)
    batches = list(replay)
    assert len(batches) == 4
    assert [b.num_requests for b in batches] == trace.per_interval().counts.tolist()
    lengths = [len(t) for b in batches for t in b.tokens]
    assert lengths == trace.context_tokens.tolist()
    assert np.concatenate([b.gen_lens for b in batches]).tolist() == trace.generated_tokens.tolist()
    assert [b.tokens for b in TraceReplay(trace, load_sharegpt(), tokenizer, seed=5, separator_id=2)] == \
        [b.tokens for b in batches]


@pytest.mark.parametrize("name", ["sharegpt", "sharegpt_512", "code", "azure_conv", "azure_code"])
def test_every_workload_config_builds(tokenizer, name: str) -> None:
    overrides = [f"workload={name}", "workload.num_batches=1"]
    if name.startswith("azure"):
        overrides += ["workload.azure.duration_s=3", "workload.azure.peak=true", "workload.azure.max_context_tokens=256"]
    cfg = compose("stats", overrides)
    work = build_workload(cfg.workload, tokenizer, separator_id=2)
    if isinstance(work, TraceReplay):
        batches = list(work)
        assert len(batches) == 3 and sum(b.num_requests for b in batches) > 0
        assert max(len(t) for b in batches for t in b.tokens) <= 256
    else:
        batch = work.next_batch()
        assert batch.batch_size == cfg.workload.batch_size and max(batch.lengths) <= cfg.workload.prompt_len


def test_a_policy_with_two_batches_in_flight_is_served_them_together(tokenizer) -> None:
    """engine.run hands Klotski two workload batches as one executor batch, as the simulator replays it."""
    from conf import compose
    from engine.run import served_batches
    from schedulers.base import scheduler_settings

    def settings(kind: str):
        return scheduler_settings(compose("run", [f"scheduler={kind}"]).scheduler)

    def sampler() -> PromptSampler:
        return PromptSampler(load_sharegpt()[:40], tokenizer, batch_size=2, prompt_len=16, gen_len=4, seed=3)

    alone = served_batches(sampler(), 3, settings("presched"))
    paired = served_batches(sampler(), 3, settings("klotski"))
    assert [b.batch_size for b in alone] == [2, 2, 2] and [b.batch_size for b in paired] == [4, 2]
    assert paired[0].tokens == alone[0].tokens + alone[1].tokens and paired[1].tokens == alone[2].tokens
    assert paired[0].prompt_ids == alone[0].prompt_ids + alone[1].prompt_ids and paired[0].gen_len == 4
