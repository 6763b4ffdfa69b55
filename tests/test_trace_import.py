"""vLLM routing-log importer: real-format fixtures (tests/data/vllm_routing), passes, malformed lines."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from core.trace import DECODE, PREFILL, RoutingTrace, TraceFormatError
from core.trace_import import import_vllm_jsonl

DATA = Path(__file__).parent / "data" / "vllm_routing"


def _lines(name: str) -> list[dict]:
    return [json.loads(x) for x in (DATA / name).read_text().splitlines() if x.strip()]


def _row(trace: RoutingTrace, seq: int, pos: int) -> int:
    (rows,) = np.nonzero((trace.seq == seq) & (trace.pos == pos))
    assert len(rows) == 1
    return int(rows[0])


def test_absolute_positions_every_line_lands_in_its_cell() -> None:
    trace = import_vllm_jsonl(DATA / "humaneval_absolute.jsonl", num_experts=8)
    assert (trace.meta.num_experts, trace.meta.top_k, trace.meta.moe_layers) == (8, 2, (0, 1, 2, 3))
    assert trace.meta.extra["sequence_ids"] == ["humaneval/0", "humaneval/1"]
    assert trace.num_rows == 5 + 3 and trace.num_steps == 2  # one step per sequence
    assert np.all(trace.phase == PREFILL) and np.all(trace.token == -1)
    for rec in _lines("humaneval_absolute.jsonl"):
        r = _row(trace, rec["problem_id"], rec["token_idx"])
        assert trace.experts[rec["layer"], r].tolist() == rec["experts"]
        np.testing.assert_allclose(trace.weights[rec["layer"], r], rec["gating_probs"], rtol=1e-6)


def test_forward_pass_indices_become_prefill_and_decode_steps() -> None:
    trace = import_vllm_jsonl(DATA / "forward_passes.jsonl")
    # problem 0: a 3-token prefill then 2 decode steps; problem 1: 2-token prefill, 1 decode step
    assert trace.step.tolist() == [0, 0, 0, 1, 2, 3, 3, 4]
    assert trace.pos.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert trace.seq.tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    assert trace.phase.tolist() == [PREFILL] * 3 + [DECODE] * 2 + [PREFILL] * 2 + [DECODE]
    lines = _lines("forward_passes.jsonl")
    decode_1 = [rec for rec in lines[12:16]]  # problem 0, first decode pass, layers 0..3
    assert [rec["layer"] for rec in decode_1] == [0, 1, 2, 3]
    for rec in decode_1:
        assert trace.experts[rec["layer"], 3].tolist() == rec["experts"]
    assert trace.meta.num_experts == max(max(r["experts"]) for r in lines) + 1
    assert trace.meta.extra["num_experts_inferred"] is True


def test_logger_with_meta_header_and_topk_aliases(tmp_path: Path) -> None:
    trace = import_vllm_jsonl(DATA / "moe_logger.jsonl", num_experts=60)
    assert trace.meta.model == "Qwen/Qwen1.5-MoE-A2.7B-Chat"
    assert trace.meta.moe_layers == (1, 2) and trace.meta.top_k == 4
    assert trace.meta.extra["header"]["vllm_version"] == "0.15.1"
    rec = _lines("moe_logger.jsonl")[-1]  # r2, token 1, decoder layer 2 -> MoE layer index 1
    assert trace.experts[1, _row(trace, 1, 1)].tolist() == rec["topk_ids"]
    back = RoutingTrace.load(trace.save(tmp_path / "t.npz"))
    np.testing.assert_array_equal(back.experts, trace.experts)
    assert back.meta == trace.meta


def _broken(tmp_path: Path, line_no: int, text: str, name: str = "humaneval_absolute.jsonl") -> Path:
    lines = (DATA / name).read_text().splitlines()
    lines[line_no - 1] = text
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("text,message", [
    ('{"problem_id": 0, "layer": 0, "experts": [1, 2], "gating_probs": [0.5, 0.5], "token_idx": 3',
     "invalid JSON"),
    ('[1, 2]', "expected a JSON object"),
    ('{"layer": 0, "experts": [1, 2], "gating_probs": [0.5, 0.5], "token_idx": 3}', "needs a sequence id"),
    ('{"problem_id": 0, "layer": 0, "experts": [1, 2], "gating_probs": [0.5, 0.5]}', "needs a token index"),
    ('{"problem_id": 0, "layer": -1, "experts": [1, 2], "gating_probs": [0.5, 0.5], "token_idx": 3}', "'layer'"),
    ('{"problem_id": 0, "layer": 0, "experts": [1, 2, 3], "gating_probs": [0.3, 0.3, 0.4], "token_idx": 3}',
     "has 3 entries, earlier lines have top-k = 2"),
    ('{"problem_id": 0, "layer": 0, "experts": [1, 1], "gating_probs": [0.5, 0.5], "token_idx": 3}', "repeats"),
    ('{"problem_id": 0, "layer": 0, "experts": [1, 9], "gating_probs": [0.5, 0.5], "token_idx": 3}',
     "expert id 9 >= num_experts 8"),
    ('{"problem_id": 0, "layer": 0, "experts": [1, 2], "gating_probs": [0.5], "token_idx": 3}', "gating_probs"),
    ('{"type": "stats", "problem_id": 0}', "unknown record type"),
])
def test_malformed_line_names_file_and_line(tmp_path: Path, text: str, message: str) -> None:
    path = _broken(tmp_path, 4, text)
    with pytest.raises(TraceFormatError, match=rf"log\.jsonl:4: .*{message}"):
        import_vllm_jsonl(path, num_experts=8)


def test_token_missing_a_layer_fails_or_is_dropped(tmp_path: Path) -> None:
    lines = (DATA / "humaneval_absolute.jsonl").read_text().splitlines()
    del lines[5 * 2 + 3]  # problem 0, layer 2, token 3
    path = tmp_path / "gap.jsonl"
    path.write_text("\n".join(lines) + "\n")
    # the token first appears on line 4 (layer 0); it lacks layer 2
    with pytest.raises(TraceFormatError, match=r"gap\.jsonl:4: sequence 'humaneval/0' token 3 has no routing for "
                                               r"layer\(s\) \[2\]"):
        import_vllm_jsonl(path)
    trace = import_vllm_jsonl(path, drop_incomplete=True)
    assert trace.num_rows == 7 and 3 not in trace.pos[trace.seq == 0].tolist()
    assert trace.meta.extra["dropped_tokens"] == 1


def test_empty_or_missing_file(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(TraceFormatError, match="no routing records"):
        import_vllm_jsonl(tmp_path / "empty.jsonl")
    with pytest.raises(TraceFormatError, match="cannot read"):
        import_vllm_jsonl(tmp_path / "absent.jsonl")
