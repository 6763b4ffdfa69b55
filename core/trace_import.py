"""Import public vLLM routing logs (JSONL) into a `RoutingTrace`.

Public MoE routing logs captured from vLLM (a hook after `FusedMoE.select_experts`) write one JSON
object per line: one line per sequence id, token index and MoE layer. Accepted keys:

| key                                               | type             | meaning                                  |
|---------------------------------------------------|------------------|------------------------------------------|
| `problem_id` / `seq_id` / `request_id` / `req_id` | int or str       | sequence (prompt) the token belongs to   |
| `dataset` (optional)                              | str              | namespace of the sequence id             |
| `token_idx` / `token_pos`                         | int >= 0         | token index (see below)                  |
| `layer`                                           | int >= 0         | decoder-layer index of the MoE block     |
| `experts` (alias `topk_ids`)                      | list[int], len k | experts the router chose, best first     |
| `gating_probs` (alias `topk_weights`)             | list[float]      | their routing weights                    |
| `phase` (optional)                                | "prefill" / "decode" | decode: the token is a step of its own |

Example line: `{"dataset": "humaneval", "problem_id": 0, "layer": 5, "experts": [6, 2],
"gating_probs": [0.57, 0.43], "token_idx": 17}`. Lines with `"type": "meta"` are headers (their
`model_id` names the model); `"type": "route"` lines are records; blank lines are skipped. k must be
the same on every line.

Token indices come in two flavours, both handled: absolute positions in the sequence (each
(sequence, token, layer) appears once), or indices within a forward pass as a raw hook logs them
(restarting at 0 for every decode step). A forward pass of a sequence ends when one of its
(token, layer) pairs repeats; a new pass then continues the positions after the previous one.
Each (sequence, pass) becomes one trace step; the first pass of a sequence is marked prefill, later
ones decode (a log with absolute positions therefore has one prefill step per sequence). A decode-only
log says so: a `"phase": "decode"` field on its lines, or `phase=LogPhase.decode` for the whole file;
every decode token is then one decode step of its sequence (nothing is taken for a prefill).

Also here: `load_trace_file` (a .npz trace or a JSONL log, by suffix) and `import_hf_router_logits`,
the routing of a Hugging Face MoE run with `output_router_logits=True` (`save_hf_router_logits`).

Every row (token) must have routing for every MoE layer present in the file; otherwise the import
fails naming the line where the token first appears, or, with `drop_incomplete=True`, such tokens are
dropped and counted in `meta.extra["dropped_tokens"]`. Malformed lines raise `TraceFormatError` with
the file and line number.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from core.trace import DECODE, PREFILL, RoutingTrace, TraceFormatError, TraceMeta, load_trace

SEQ_KEYS = ("problem_id", "seq_id", "request_id", "req_id")
TOKEN_KEYS = ("token_idx", "token_pos")
EXPERT_KEYS = ("experts", "topk_ids")
WEIGHT_KEYS = ("gating_probs", "topk_weights")
PHASES = {"prefill": False, "decode": True, PREFILL: False, DECODE: True}  # a line's `phase` -> is a decode token


class LogPhase(enum.Enum):
    auto = "auto"  # a sequence's first forward pass is its prefill, later passes decode steps (lines may say `phase`)
    decode = "decode"  # a decode-only log: every token is one decode step of its sequence


class TraceFileFormat(enum.Enum):
    auto = "auto"  # by suffix: .npz moescope trace, .jsonl / .json vLLM routing log
    npz = "npz"
    vllm_jsonl = "vllm_jsonl"


def _first(rec: dict[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        if key in rec:
            return rec[key]
    return None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class _Sequence:
    """Per-sequence state while reading: its forward pass and what the pass has seen."""

    ordinal: int
    name: str
    passes: int = 0
    offset: int = 0  # positions taken by earlier passes
    max_token: int = -1
    seen: set[tuple[int, int]] = field(default_factory=set)


class _Columns:
    """Parsed lines as parallel lists (converted to arrays once)."""

    def __init__(self) -> None:
        self.seq: list[int] = []
        self.pass_: list[int] = []
        self.pos: list[int] = []
        self.token: list[int] = []
        self.layer: list[int] = []
        self.line: list[int] = []
        self.decode: list[bool] = []
        self.experts: list[list[int]] = []
        self.weights: list[list[float]] = []


def _parse_record(rec: Any, fail: Any, k: Optional[int], num_experts: Optional[int]
                  ) -> tuple[str, int, int, list[int], list[float]]:
    if not isinstance(rec, dict):
        fail(f"expected a JSON object, got {type(rec).__name__}")
    sid = _first(rec, SEQ_KEYS)
    if sid is None or not (_is_int(sid) or isinstance(sid, str)):
        fail(f"needs a sequence id ({' / '.join(SEQ_KEYS)}) that is an int or a string")
    name = f"{rec['dataset']}/{sid}" if isinstance(rec.get("dataset"), str) else str(sid)
    tok, layer = _first(rec, TOKEN_KEYS), rec.get("layer")
    if not _is_int(tok) or tok < 0:
        fail(f"needs a token index ({' / '.join(TOKEN_KEYS)}) that is an int >= 0, got {tok!r}")
    if not _is_int(layer) or layer < 0:
        fail(f"needs 'layer' as an int >= 0, got {layer!r}")
    experts, weights = _first(rec, EXPERT_KEYS), _first(rec, WEIGHT_KEYS)
    if not isinstance(experts, list) or not experts or not all(_is_int(e) and e >= 0 for e in experts):
        fail(f"'experts' must be a non-empty list of ints >= 0, got {experts!r}")
    if len(set(experts)) != len(experts):
        fail(f"'experts' repeats an expert: {experts}")
    if k is not None and len(experts) != k:
        fail(f"'experts' has {len(experts)} entries, earlier lines have top-k = {k}")
    if num_experts is not None and max(experts) >= num_experts:
        fail(f"expert id {max(experts)} >= num_experts {num_experts}")
    if (not isinstance(weights, list) or len(weights) != len(experts)
            or not all(isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) for w in weights)):
        fail(f"'gating_probs' must be {len(experts)} finite numbers, got {weights!r}")
    if any(w < 0 for w in weights):
        fail(f"'gating_probs' must be >= 0 (routing weights), got {weights!r}")
    return name, tok, layer, experts, [float(w) for w in weights]


def import_vllm_jsonl(path: str | Path, num_experts: Optional[int] = None, model: Optional[str] = None,
                      drop_incomplete: bool = False, phase: LogPhase = LogPhase.auto,
                      drop_key: str = "drop_incomplete") -> RoutingTrace:
    """Read a vLLM routing log (format in the module docstring) into a validated `RoutingTrace`.

    num_experts: experts per MoE layer; None takes the largest id seen + 1 (recorded as inferred in
    `meta.extra`, since an expert never chosen is invisible in a log). model: the model name in the
    trace metadata (default: the header's `model_id`, else the file name). phase: `LogPhase.decode` reads every
    token as a decode step (a decode-only log); `auto` lets a line's `phase` field say so. drop_key: the config
    key of `drop_incomplete` in the calling task, named by the error an incomplete token raises.
    """
    path = Path(path)
    where = str(path)
    if num_experts is not None and num_experts < 1:
        raise ValueError(f"num_experts: must be >= 1, got {num_experts}")
    cols = _Columns()
    seqs: dict[str, _Sequence] = {}
    header: dict[str, Any] = {}
    k: Optional[int] = None
    try:
        fh = open(path, "rb")  # decoded line by line, so that a non-UTF-8 line is named
    except OSError as exc:
        raise TraceFormatError(f"{where}: cannot read: {exc}") from None
    with fh:
        for lineno, raw in enumerate(fh, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise TraceFormatError(f"{where}:{lineno}: not UTF-8 text ({exc.reason} at byte {exc.start} of the "
                                       "line)") from None
            if not text.strip():
                continue

            def fail(msg: str, _line: int = lineno) -> None:
                raise TraceFormatError(f"{where}:{_line}: {msg}")

            try:
                rec = json.loads(text)
            except json.JSONDecodeError as exc:
                fail(f"invalid JSON: {exc.msg} (column {exc.colno})")
            kind = rec.get("type") if isinstance(rec, dict) else None
            if kind == "meta":
                header = rec
                continue
            if kind not in (None, "route"):
                fail(f"unknown record type {kind!r} (expected 'meta' or 'route')")
            name, tok, layer, experts, weights = _parse_record(rec, fail, k, num_experts)
            line_phase = rec.get("phase")
            if line_phase is not None and line_phase not in PHASES:
                fail(f"'phase' must be 'prefill' or 'decode', got {line_phase!r}")
            decode = phase is LogPhase.decode if line_phase is None else PHASES[line_phase]
            k = len(experts)
            seq = seqs.setdefault(name, _Sequence(len(seqs), name))
            if (tok, layer) in seq.seen:  # the same token and layer again: a new forward pass
                seq.passes += 1
                seq.offset += seq.max_token + 1
                seq.max_token = -1
                seq.seen.clear()
            seq.seen.add((tok, layer))
            seq.max_token = max(seq.max_token, tok)
            cols.seq.append(seq.ordinal)
            cols.pass_.append(seq.passes)
            cols.token.append(tok)
            cols.pos.append(seq.offset + tok)
            cols.layer.append(layer)
            cols.line.append(lineno)
            cols.decode.append(decode)
            cols.experts.append(experts)
            cols.weights.append(weights)
    if not cols.line:
        raise TraceFormatError(f"{where}: no routing records")
    return _assemble(cols, seqs, header, k or 0, num_experts, model, drop_incomplete, path, drop_key)


def _assemble(cols: _Columns, seqs: dict[str, _Sequence], header: dict[str, Any], k: int,
              num_experts: Optional[int], model: Optional[str], drop_incomplete: bool, path: Path,
              drop_key: str = "drop_incomplete") -> RoutingTrace:
    seq, pas, pos = (np.asarray(x, np.int64) for x in (cols.seq, cols.pass_, cols.pos))
    token, line = np.asarray(cols.token, np.int64), np.asarray(cols.line, np.int64)
    layers = np.unique(np.asarray(cols.layer, np.int64))
    layer_idx = np.searchsorted(layers, np.asarray(cols.layer, np.int64))
    L = len(layers)

    # one row per (sequence, pass, token); steps are (sequence, pass) in order of first appearance, a decode
    # token being a step of its own
    decode = np.asarray(cols.decode, bool)
    step_key = np.stack([seq, pas, np.where(decode, token, -1)], axis=1)
    _, step_first, step_inv = np.unique(step_key, axis=0, return_index=True, return_inverse=True)
    step_inv = step_inv.reshape(-1)
    step_rank = np.empty_like(step_first)
    step_rank[np.argsort(step_first, kind="stable")] = np.arange(len(step_first))
    step_of_line = step_rank[step_inv]
    row_key = step_of_line * (int(token.max()) + 1) + token
    row_keys, row_first, row_inv = np.unique(row_key, return_index=True, return_inverse=True)
    per_row = np.bincount(row_inv, minlength=len(row_keys))
    complete = per_row == L
    dropped = int((~complete).sum())
    if dropped and not drop_incomplete:
        bad = int(np.flatnonzero(~complete)[np.argmin(line[row_first[~complete]])])
        have = set(layers[layer_idx[row_inv == bad]].tolist())
        missing = [int(x) for x in layers if x not in have]
        name = next(s.name for s in seqs.values() if s.ordinal == seq[row_first[bad]])
        raise TraceFormatError(
            f"{path}:{int(line[row_first[bad]])}: sequence {name!r} token {int(token[row_first[bad]])} has no routing "
            f"for layer(s) {missing} ({dropped} incomplete tokens; {drop_key}=true drops them)")
    keep_rows = np.flatnonzero(complete)
    new_row = np.full(len(row_keys), -1, np.int64)
    new_row[keep_rows] = np.arange(len(keep_rows))  # row_keys are sorted: rows come out in step, token order
    lines_kept = complete[row_inv]
    r = new_row[row_inv[lines_kept]]
    li = layer_idx[lines_kept]
    n = len(keep_rows)
    experts = np.zeros((L, n, k), np.int64)
    weights = np.zeros((L, n, k), np.float32)
    experts[li, r] = np.asarray(cols.experts, np.int64)[lines_kept]
    weights[li, r] = np.asarray(cols.weights, np.float32)[lines_kept]

    first = row_first[keep_rows]
    row_seq = seq[first]
    seen_max = int(experts.max()) + 1 if n else 1
    inferred = num_experts is None
    meta = TraceMeta(
        model=model or str(header.get("model_id") or header.get("model") or path.stem),
        num_experts=seen_max if inferred else int(num_experts),  # type: ignore[arg-type]
        top_k=k, moe_layers=tuple(int(x) for x in layers), source=f"vllm_jsonl:{path.name}",
        extra={"importer": "core.trace_import.import_vllm_jsonl", "lines": len(cols.line),
               "sequence_ids": [s.name for s in sorted(seqs.values(), key=lambda s: s.ordinal)],
               "num_experts_inferred": inferred, "dropped_tokens": dropped,
               **({"header": {k_: v for k_, v in header.items() if k_ != "type"}} if header else {})})
    return RoutingTrace(meta=meta, experts=experts.astype(np.int16), weights=weights,
                        step=step_of_line[first].astype(np.int32), batch=row_seq.astype(np.int32),
                        seq=row_seq.astype(np.int32), pos=pos[first].astype(np.int32),
                        token=np.full(n, -1, np.int32),
                        phase=np.where((pas[first] == 0) & ~decode[first], PREFILL, DECODE).astype(np.int8))


def load_trace_file(path: str | Path, fmt: TraceFileFormat = TraceFileFormat.auto, num_experts: Optional[int] = None,
                    drop_incomplete: bool = False, with_hidden: bool = True, phase: LogPhase = LogPhase.auto,
                    drop_key: str = "drop_incomplete") -> RoutingTrace:
    """A routing trace from a file: a moescope `.npz` trace or a vLLM routing log (`.jsonl`, `.json`; read with
    `drop_incomplete` and `phase`, an incomplete token's error naming the config key `drop_key`)."""
    path = Path(path)
    if fmt is TraceFileFormat.auto:
        suffix = path.suffix.lower()
        if suffix not in (".npz", ".jsonl", ".json"):
            raise ValueError(f"trace: cannot tell the format of {path} from its suffix; set trace_format=npz|vllm_jsonl")
        fmt = TraceFileFormat.npz if suffix == ".npz" else TraceFileFormat.vllm_jsonl
    if fmt is TraceFileFormat.npz:
        return load_trace(path, with_hidden=with_hidden)
    return import_vllm_jsonl(path, num_experts=num_experts, drop_incomplete=drop_incomplete, phase=phase,
                             drop_key=drop_key)


# ---- Hugging Face `output_router_logits` ------------------------------------------------------------------------
def save_hf_router_logits(path: str | Path, router_logits: Sequence[Any], batch: int, seq_len: int,
                          attention_mask: Optional[Any] = None, model: str = "hf") -> Path:
    """Save the `router_logits` of one Hugging Face MoE forward pass (`model(ids, output_router_logits=True)`:
    one [batch * seq_len, E] tensor per MoE layer) as the .npz `import_hf_router_logits` reads:
    `router_logits` float32 [L, B, S, E], `attention_mask` [B, S] (1 = a real token), `model`."""
    layers = [np.asarray(x.detach().float().cpu() if hasattr(x, "detach") else x, np.float32) for x in router_logits]
    if not layers:
        raise ValueError("save_hf_router_logits: no router logits (run the model with output_router_logits=True)")
    logits = np.stack([x.reshape(batch, seq_len, -1) for x in layers])
    mask = np.ones((batch, seq_len), np.int8) if attention_mask is None else np.asarray(
        attention_mask.cpu() if hasattr(attention_mask, "cpu") else attention_mask).astype(np.int8)
    path = Path(path)
    np.savez(path, router_logits=logits, attention_mask=mask, model=np.array(model))
    return path


def import_hf_router_logits(path: str | Path, top_k: int, normalize: bool = True) -> RoutingTrace:
    """The routing of a saved HF forward pass (`save_hf_router_logits`): each real token's top-k experts of the
    softmax of its router logits, weights renormalised over the k (`normalize`, as Mixtral / Qwen3-MoE route).
    The pass is one prefill step of B sequences (padding left out)."""
    path = Path(path)
    try:
        data = np.load(path, allow_pickle=False)
        logits = np.asarray(data["router_logits"], np.float32)
        mask = np.asarray(data["attention_mask"]).astype(bool) if "attention_mask" in data.files else None
        model = str(data["model"]) if "model" in data.files else path.stem
    except (OSError, ValueError, KeyError) as exc:
        raise TraceFormatError(f"{path}: not a saved HF router-logits file (router_logits [L, B, S, E]): {exc}") from None
    if logits.ndim != 4:
        raise TraceFormatError(f"{path}: router_logits must be [layers, batch, seq, experts], got shape {logits.shape}")
    L, B, S, E = logits.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k: {top_k} outside [1, {E}] for {path}")
    mask = np.ones((B, S), bool) if mask is None else mask
    if mask.shape != (B, S):
        raise TraceFormatError(f"{path}: attention_mask of shape {mask.shape}, router_logits have [B, S] = {(B, S)}")
    b, s = np.nonzero(mask)
    flat = logits[:, b, s]  # [L, N, E]
    probs = np.exp(flat - flat.max(axis=2, keepdims=True))
    probs /= probs.sum(axis=2, keepdims=True)
    experts = np.argsort(-probs, axis=2, kind="stable")[:, :, :top_k]
    weights = np.take_along_axis(probs, experts, axis=2)
    if normalize:
        weights /= weights.sum(axis=2, keepdims=True)
    pos = (np.cumsum(mask, axis=1) - 1)[b, s]
    meta = TraceMeta(model=model, num_experts=E, top_k=top_k, moe_layers=tuple(range(L)), source=f"hf_router_logits:"
                     f"{path.name}", extra={"importer": "core.trace_import.import_hf_router_logits",
                                            "normalized_topk": normalize})
    n = b.size
    return RoutingTrace(meta=meta, experts=experts.astype(np.int16), weights=weights.astype(np.float32),
                        step=np.zeros(n, np.int32), batch=np.zeros(n, np.int32), seq=b.astype(np.int32),
                        pos=pos.astype(np.int32), token=np.full(n, -1, np.int32), phase=np.full(n, PREFILL, np.int8))


__all__ = ["LogPhase", "TraceFileFormat", "import_vllm_jsonl", "load_trace_file", "save_hf_router_logits",
           "import_hf_router_logits"]
