"""Routing traces: which experts every token chose in every MoE layer, forward pass by forward pass.

File format: one `.npz` (numpy's zip of arrays), schema `moescope.routing_trace` version 1.
N is the number of token rows over the whole trace, L the number of MoE layers, k the top-k,
H the hidden size. Rows of one forward pass ("step") are contiguous and steps ascend.

| array     | dtype   | shape     | meaning                                                        |
|-----------|---------|-----------|----------------------------------------------------------------|
| `meta`    | str     | ()        | JSON object, see `TraceMeta`                                   |
| `experts` | int16   | [L, N, k] | expert ids the router chose for row n at MoE layer l           |
| `weights` | float32 | [L, N, k] | the weights that multiply those experts' outputs               |
| `step`    | int32   | [N]       | forward-pass index, global over the trace (prefill, decodes…)  |
| `batch`   | int32   | [N]       | batch index (a prefill starts a batch)                         |
| `seq`     | int32   | [N]       | sequence id, global over the trace                             |
| `pos`     | int32   | [N]       | position of the token in its sequence                          |
| `token`   | int32   | [N]       | token id (-1 where unknown, e.g. imported traces)              |
| `phase`   | int8    | [N]       | 0 prefill, 1 decode                                            |
| `hidden`  | float16 | [L, N, H] | optional: the gate input (normalised hidden state) per layer   |

Padding tokens are never recorded. `TraceRecorder` builds a trace step by step; `RoutingTrace.load`
validates a file and names the file and the array that is wrong.
"""

from __future__ import annotations

import dataclasses
import json
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import numpy as np

SCHEMA = "moescope.routing_trace"
VERSION = 1
PREFILL, DECODE = 0, 1


class TraceFormatError(ValueError):
    """A trace file or array that does not follow the schema (message names file and array)."""


@dataclass(frozen=True)
class TraceMeta:
    model: str
    num_experts: int
    top_k: int
    moe_layers: tuple[int, ...]  # decoder-layer index of each MoE layer
    hidden_size: int = 0
    family: str = ""
    source: str = ""  # workload / importer that produced the trace
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return len(self.moe_layers)

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["moe_layers"] = list(self.moe_layers)
        return json.dumps({"schema": SCHEMA, "version": VERSION, **d})

    @classmethod
    def from_json(cls, text: str, where: str = "<trace>") -> "TraceMeta":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(f"{where}: array 'meta' is not JSON: {exc}") from None
        if d.get("schema") != SCHEMA:
            raise TraceFormatError(f"{where}: meta.schema is {d.get('schema')!r}, expected {SCHEMA!r}")
        if d.get("version") != VERSION:
            raise TraceFormatError(f"{where}: meta.version {d.get('version')!r} unsupported (reader is v{VERSION})")
        try:
            return cls(model=str(d["model"]), num_experts=int(d["num_experts"]), top_k=int(d["top_k"]),
                       moe_layers=tuple(int(x) for x in d["moe_layers"]), hidden_size=int(d.get("hidden_size", 0)),
                       family=str(d.get("family", "")), source=str(d.get("source", "")),
                       extra=dict(d.get("extra", {})))
        except KeyError as exc:
            raise TraceFormatError(f"{where}: meta lacks key {exc.args[0]!r}") from None


_ROW_ARRAYS = {"step": np.int32, "batch": np.int32, "seq": np.int32, "pos": np.int32, "token": np.int32,
               "phase": np.int8}


@dataclass
class RoutingTrace:
    meta: TraceMeta
    experts: np.ndarray  # int16 [L, N, k]
    weights: np.ndarray  # float32 [L, N, k]
    step: np.ndarray  # int32 [N]
    batch: np.ndarray  # int32 [N]
    seq: np.ndarray  # int32 [N]
    pos: np.ndarray  # int32 [N]
    token: np.ndarray  # int32 [N]
    phase: np.ndarray  # int8 [N]
    hidden: Optional[np.ndarray] = None  # float16 [L, N, H]

    def __post_init__(self) -> None:
        self.validate()

    # ---- shape -------------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return int(self.step.shape[0])

    @property
    def num_layers(self) -> int:
        return self.meta.num_layers

    @property
    def num_steps(self) -> int:
        return int(len(self.step_bounds()) - 1)

    def step_bounds(self) -> np.ndarray:
        """Row offsets where each step starts, plus the end: steps are rows [b[i], b[i+1])."""
        if self.num_rows == 0:
            return np.zeros(1, dtype=np.int64)
        change = np.flatnonzero(np.diff(self.step)) + 1
        return np.concatenate([[0], change, [self.num_rows]]).astype(np.int64)

    def iter_steps(self) -> Iterator[tuple[int, slice]]:
        """(step id, row slice) for every forward pass in order."""
        b = self.step_bounds()
        for i in range(len(b) - 1):
            yield int(self.step[b[i]]), slice(int(b[i]), int(b[i + 1]))

    def expert_loads(self, rows: slice | np.ndarray | None = None) -> np.ndarray:
        """Tokens per expert: int64 [L, E] over the selected rows (all rows by default)."""
        ex = self.experts if rows is None else self.experts[:, rows]
        L, E = self.num_layers, self.meta.num_experts
        out = np.zeros((L, E), dtype=np.int64)
        for layer in range(L):
            out[layer] = np.bincount(ex[layer].reshape(-1).astype(np.int64), minlength=E)[:E]
        return out

    def select(self, rows: slice | np.ndarray) -> "RoutingTrace":
        """A trace holding only `rows` (a slice or a boolean/int index over rows)."""
        return RoutingTrace(meta=self.meta, experts=self.experts[:, rows], weights=self.weights[:, rows],
                            step=self.step[rows], batch=self.batch[rows], seq=self.seq[rows], pos=self.pos[rows],
                            token=self.token[rows], phase=self.phase[rows],
                            hidden=None if self.hidden is None else self.hidden[:, rows])

    # ---- validation / io -----------------------------------------------------------------------
    def validate(self, where: str = "<trace>") -> None:
        L, k, E = self.meta.num_layers, self.meta.top_k, self.meta.num_experts
        n = self.step.shape[0] if self.step.ndim == 1 else -1

        def fail(array: str, msg: str) -> None:
            raise TraceFormatError(f"{where}: array '{array}': {msg}")

        for name, dtype in _ROW_ARRAYS.items():
            arr = getattr(self, name)
            if arr.ndim != 1 or arr.shape[0] != n:
                fail(name, f"shape {arr.shape}, expected ({n},)")
            if arr.dtype != dtype:
                setattr(self, name, arr.astype(dtype))
        for name in ("experts", "weights"):
            arr = getattr(self, name)
            if arr.shape != (L, n, k):
                fail(name, f"shape {arr.shape}, expected (L={L}, N={n}, k={k})")
        if self.experts.dtype != np.int16:
            self.experts = self.experts.astype(np.int16)
        if self.weights.dtype != np.float32:
            self.weights = self.weights.astype(np.float32)
        if n and (self.experts.min() < 0 or self.experts.max() >= E):
            fail("experts", f"ids must lie in [0, {E}); found [{self.experts.min()}, {self.experts.max()}]")
        if n and not (np.isfinite(self.weights).all() and self.weights.min() >= 0):
            bad = np.argwhere(~(self.weights >= 0))[0]
            fail("weights", f"routing weights must be finite and >= 0; found {self.weights[tuple(bad)]} at "
                            f"(layer {bad[0]}, row {bad[1]}, slot {bad[2]})")
        if n and np.any(np.diff(self.step) < 0):
            bad = int(np.flatnonzero(np.diff(self.step) < 0)[0]) + 1
            fail("step", f"steps must ascend; row {bad} goes back from {self.step[bad - 1]} to {self.step[bad]}")
        if n and not np.isin(self.phase, (PREFILL, DECODE)).all():
            fail("phase", "values must be 0 (prefill) or 1 (decode)")
        if self.hidden is not None:
            if self.hidden.ndim != 3 or self.hidden.shape[:2] != (L, n):
                fail("hidden", f"shape {self.hidden.shape}, expected (L={L}, N={n}, H)")
            if self.meta.hidden_size and self.hidden.shape[2] != self.meta.hidden_size:
                fail("hidden", f"hidden size {self.hidden.shape[2]} != meta.hidden_size {self.meta.hidden_size}")

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays: dict[str, Any] = {"meta": np.array(self.meta.to_json()), "experts": self.experts,
                                  "weights": self.weights}
        arrays.update({name: getattr(self, name) for name in _ROW_ARRAYS})
        if self.hidden is not None:
            arrays["hidden"] = self.hidden.astype(np.float16)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as fh:
            np.savez(fh, **arrays)
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path, with_hidden: bool = True) -> "RoutingTrace":
        path = Path(path)
        where = str(path)
        if not path.is_file():
            raise TraceFormatError(f"{where}: no such trace file")
        try:
            data = np.load(path, allow_pickle=False)
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
            raise TraceFormatError(f"{where}: not a .npz trace: {exc or 'empty file'}") from None
        with data:
            names = set(data.files)
            missing = {"meta", "experts", "weights", *_ROW_ARRAYS} - names
            if missing:
                raise TraceFormatError(f"{where}: missing arrays {sorted(missing)}")
            meta = TraceMeta.from_json(str(_member(data, "meta", where)), where)
            fields = {name: _member(data, name, where) for name in ("experts", "weights", *_ROW_ARRAYS)}
            hidden = _member(data, "hidden", where) if (with_hidden and "hidden" in names) else None
        trace = cls.__new__(cls)
        trace.meta, trace.hidden = meta, hidden
        for name, value in fields.items():
            setattr(trace, name, value)
        trace.validate(where)
        return trace

    @classmethod
    def concat(cls, traces: Sequence["RoutingTrace"]) -> "RoutingTrace":
        """Join traces of the same model; step, batch and seq ids are offset to stay unique."""
        if not traces:
            raise ValueError("concat: no traces")
        meta = traces[0].meta
        parts: dict[str, list[np.ndarray]] = {k: [] for k in ("experts", "weights", "hidden", *_ROW_ARRAYS)}
        offs = {"step": 0, "batch": 0, "seq": 0}
        keep_hidden = all(t.hidden is not None for t in traces)
        for t in traces:
            if (t.meta.num_experts, t.meta.top_k, t.meta.moe_layers) != (meta.num_experts, meta.top_k, meta.moe_layers):
                raise ValueError(f"concat: trace of {t.meta.model} does not match {meta.model}")
            for name in _ROW_ARRAYS:
                arr = getattr(t, name)
                parts[name].append(arr + offs[name] if name in offs else arr)
            for name in offs:
                arr = getattr(t, name)
                offs[name] += int(arr.max()) + 1 if arr.size else 0
            parts["experts"].append(t.experts)
            parts["weights"].append(t.weights)
            if keep_hidden:
                parts["hidden"].append(t.hidden)
        return cls(meta=meta, experts=np.concatenate(parts["experts"], axis=1),
                   weights=np.concatenate(parts["weights"], axis=1),
                   hidden=np.concatenate(parts["hidden"], axis=1) if keep_hidden else None,
                   **{name: np.concatenate(parts[name]) for name in _ROW_ARRAYS})


class TraceRecorder:
    """Accumulates routing, step by step, into a `RoutingTrace`.

    `add_step` takes one forward pass: per MoE layer the [T, k] experts and weights of the T real
    (non-padding) tokens, and optionally their [T, H] gate inputs.
    """

    def __init__(self, meta: TraceMeta, keep_hidden: bool = False):
        self.meta = meta
        self.keep_hidden = keep_hidden
        self._rows: dict[str, list[np.ndarray]] = {k: [] for k in ("experts", "weights", "hidden", *_ROW_ARRAYS)}
        self._step = 0
        self._batch = -1

    @property
    def num_steps(self) -> int:
        return self._step

    def add_step(self, experts: Sequence[np.ndarray], weights: Sequence[np.ndarray], *, seq: np.ndarray,
                 pos: np.ndarray, token: Optional[np.ndarray] = None, phase: int,
                 hidden: Optional[Sequence[np.ndarray]] = None) -> None:
        if len(experts) != self.meta.num_layers or len(weights) != self.meta.num_layers:
            raise ValueError(f"add_step: expected {self.meta.num_layers} MoE layers, got {len(experts)}")
        n = int(np.asarray(seq).shape[0])
        if phase == PREFILL:
            self._batch += 1
        self._rows["experts"].append(np.stack([np.asarray(e, dtype=np.int16).reshape(n, -1) for e in experts]))
        self._rows["weights"].append(np.stack([np.asarray(w, dtype=np.float32).reshape(n, -1) for w in weights]))
        if self.keep_hidden:
            if hidden is None:
                raise ValueError("add_step: recorder keeps hidden states but none were given")
            self._rows["hidden"].append(np.stack([np.asarray(h, dtype=np.float16) for h in hidden]))
        self._rows["step"].append(np.full(n, self._step, np.int32))
        self._rows["batch"].append(np.full(n, max(self._batch, 0), np.int32))
        self._rows["seq"].append(np.asarray(seq, np.int32))
        self._rows["pos"].append(np.asarray(pos, np.int32))
        self._rows["token"].append(np.full(n, -1, np.int32) if token is None else np.asarray(token, np.int32))
        self._rows["phase"].append(np.full(n, phase, np.int8))
        self._step += 1

    def build(self) -> RoutingTrace:
        L, k = self.meta.num_layers, self.meta.top_k
        if not self._rows["step"]:
            empty = {name: np.zeros(0, dtype) for name, dtype in _ROW_ARRAYS.items()}
            return RoutingTrace(meta=self.meta, experts=np.zeros((L, 0, k), np.int16),
                                weights=np.zeros((L, 0, k), np.float32), **empty)
        hidden = np.concatenate(self._rows["hidden"], axis=1) if self.keep_hidden else None
        return RoutingTrace(meta=self.meta, experts=np.concatenate(self._rows["experts"], axis=1),
                            weights=np.concatenate(self._rows["weights"], axis=1), hidden=hidden,
                            **{name: np.concatenate(self._rows[name]) for name in _ROW_ARRAYS})


def _member(data: Any, name: str, where: str) -> np.ndarray:
    """One array of an opened .npz, or a TraceFormatError naming the file and the array when it is damaged."""
    try:
        return data[name]
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        raise TraceFormatError(f"{where}: array '{name}' is damaged: {exc}") from None


def load_trace(path: str | Path, with_hidden: bool = True) -> RoutingTrace:
    """Load and validate a routing trace file."""
    return RoutingTrace.load(path, with_hidden=with_hidden)


__all__ = ["RoutingTrace", "TraceMeta", "TraceRecorder", "TraceFormatError", "load_trace", "PREFILL", "DECODE"]
