"""Azure LLM inference traces (Splitwise, ISCA'24): arrivals, context and generated tokens per request.

    trace = load_azure_trace("conv")                         # the shipped conversation trace
    peak = trace.window(trace.busiest_window(600), 600)      # the busiest ten minutes, t=0 at its start
    for batch in peak.per_interval(1.0):                     # MoEless §6.1: one batch per second
        batch.num_requests, batch.context_tokens, batch.generated_tokens

CSV format: a header naming `TIMESTAMP`, `ContextTokens`, `GeneratedTokens` (any column order), then
one request per row, `YYYY-MM-DD HH:MM:SS[.f…]` (up to 9 fractional digits, UTC) and two integers.
Timestamps must not go backwards. Any bad row raises `WorkloadFormatError` with the file and line.
Every transformation returns a new trace; `request_ids` keep the original row numbers (0 = first
data row) through windows, thinning and scaling.
"""

from __future__ import annotations

import calendar
import csv
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np

from core.texts import AZURE_DIR, WorkloadFormatError

SERVICES = ("code", "conv")
COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_TS = re.compile(r"^(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?$")


def azure_trace_path(service: str) -> Path:
    """The shipped CSV of a service ('code' or 'conv')."""
    if service not in SERVICES:
        raise ValueError(f"azure service: {service!r} is not one of {SERVICES}")
    return AZURE_DIR / f"AzureLLMInferenceTrace_{service}.csv"


def parse_timestamp_ns(text: str) -> int:
    """Nanoseconds since the Unix epoch of an Azure trace timestamp (UTC); ValueError if malformed."""
    m = _TS.match(text.strip())
    if not m:
        raise ValueError(f"timestamp {text!r} is not 'YYYY-MM-DD HH:MM:SS[.fraction]'")
    y, mo, d, h, mi, s = (int(g) for g in m.groups()[:6])
    frac = m.group(7) or ""
    if not (1 <= mo <= 12 and 1 <= d <= calendar.monthrange(y, mo)[1] and h < 24 and mi < 60 and s < 60):
        raise ValueError(f"timestamp {text!r} is not a valid date and time")
    seconds = calendar.timegm((y, mo, d, h, mi, s, 0, 0, 0))
    return seconds * 1_000_000_000 + int(frac.ljust(9, "0") or 0)


@dataclass(frozen=True)
class RequestBatch:
    """The requests that arrived in one interval [start_s, start_s + interval)."""

    index: int
    start_s: float
    request_ids: np.ndarray  # int64 [n]: row numbers in the source CSV
    arrival_s: np.ndarray  # float64 [n]
    context_tokens: np.ndarray  # int64 [n]
    generated_tokens: np.ndarray  # int64 [n]

    @property
    def num_requests(self) -> int:
        return int(self.request_ids.shape[0])

    @property
    def prefill_tokens(self) -> int:
        return int(self.context_tokens.sum())

    @property
    def decode_tokens(self) -> int:
        return int(self.generated_tokens.sum())


@dataclass(frozen=True)
class RequestBatches:
    """A trace cut into consecutive intervals (empty ones included, so time stays continuous)."""

    trace: "AzureTrace"
    interval_s: float
    offsets: np.ndarray  # int64 [S + 1]: batch s holds trace rows offsets[s]:offsets[s+1]

    def __len__(self) -> int:
        return int(self.offsets.shape[0] - 1)

    def __getitem__(self, s: int) -> RequestBatch:
        if not -len(self) <= s < len(self):
            raise IndexError(f"batch {s} out of range ({len(self)} batches)")
        s %= len(self)
        rows = slice(int(self.offsets[s]), int(self.offsets[s + 1]))
        t = self.trace
        return RequestBatch(s, s * self.interval_s, t.request_ids[rows], t.arrival_s[rows], t.context_tokens[rows],
                            t.generated_tokens[rows])

    def __iter__(self) -> Iterator[RequestBatch]:
        for s in range(len(self)):
            yield self[s]

    def nonempty(self) -> Iterator[RequestBatch]:
        for s in np.flatnonzero(self.counts):
            yield self[int(s)]

    @property
    def start_s(self) -> np.ndarray:
        """float64 [S]: start of each interval."""
        return np.arange(len(self), dtype=np.float64) * self.interval_s

    @property
    def counts(self) -> np.ndarray:
        """int64 [S]: requests per interval."""
        return np.diff(self.offsets)

    def _sum(self, values: np.ndarray) -> np.ndarray:
        csum = np.concatenate([[0], np.cumsum(values, dtype=np.int64)])
        return csum[self.offsets[1:]] - csum[self.offsets[:-1]]

    @property
    def context_tokens(self) -> np.ndarray:
        """int64 [S]: prompt tokens arriving per interval (MoEless Figure 3(b))."""
        return self._sum(self.trace.context_tokens)

    @property
    def generated_tokens(self) -> np.ndarray:
        """int64 [S]: tokens to generate for the requests of each interval."""
        return self._sum(self.trace.generated_tokens)


@dataclass(frozen=True)
class AzureTrace:
    """Requests of one trace, times in seconds since `start_ns` (absolute, ns since epoch UTC)."""

    name: str
    source: str
    start_ns: int
    duration_s: float  # span covered: up to the last arrival, or the window length
    arrival_s: np.ndarray  # float64 [N], ascending
    context_tokens: np.ndarray  # int64 [N]
    generated_tokens: np.ndarray  # int64 [N]
    request_ids: np.ndarray  # int64 [N]

    @property
    def num_requests(self) -> int:
        return int(self.arrival_s.shape[0])

    def _rows(self, rows: np.ndarray | slice, **changes: Any) -> "AzureTrace":
        return replace(self, arrival_s=self.arrival_s[rows], context_tokens=self.context_tokens[rows],
                       generated_tokens=self.generated_tokens[rows], request_ids=self.request_ids[rows], **changes)

    # ---- selection and scaling -----------------------------------------------------------------
    def window(self, start_s: float, duration_s: float) -> "AzureTrace":
        """Requests arriving in [start_s, start_s + duration_s), re-timed so the window starts at 0."""
        if duration_s <= 0 or start_s < 0:
            raise ValueError(f"window: need start_s >= 0 and duration_s > 0, got {start_s}, {duration_s}")
        lo, hi = np.searchsorted(self.arrival_s, [start_s, start_s + duration_s], side="left")
        sub = self._rows(slice(int(lo), int(hi)), start_ns=self.start_ns + round(start_s * 1e9),
                         duration_s=float(duration_s))
        return replace(sub, arrival_s=sub.arrival_s - start_s)

    def busiest_window(self, duration_s: float) -> float:
        """Start (s) of the window of `duration_s` holding the most requests (earliest of ties).

        MoEless replays the peak traffic of the traces; a window starting at an arrival is optimal.
        """
        if duration_s <= 0:
            raise ValueError(f"busiest_window: duration_s must be > 0, got {duration_s}")
        if self.num_requests == 0:
            return 0.0
        ends = np.searchsorted(self.arrival_s, self.arrival_s + duration_s, side="left")
        best = int(np.argmax(ends - np.arange(self.num_requests)))
        return float(self.arrival_s[best])

    def time_scaled(self, factor: float) -> "AzureTrace":
        """Arrival times multiplied by `factor` (< 1 compresses: the request rate grows by 1/factor)."""
        if not factor > 0:
            raise ValueError(f"time_scale: must be > 0, got {factor}")
        return replace(self, arrival_s=self.arrival_s * factor, duration_s=self.duration_s * factor)

    def thinned(self, fraction: float, seed: int = 0) -> "AzureTrace":
        """A seeded random subset of round(fraction * N) requests (arrival pattern kept, rate scaled)."""
        if not 0 < fraction <= 1:
            raise ValueError(f"request_fraction: must be in (0, 1], got {fraction}")
        if fraction == 1:
            return self
        n = round(fraction * self.num_requests)
        keep = np.sort(np.random.default_rng(seed).choice(self.num_requests, size=n, replace=False))
        return self._rows(keep)

    def clipped(self, max_context: Optional[int] = None, max_generated: Optional[int] = None) -> "AzureTrace":
        """Token counts capped (for models with a short context); None leaves a count as it is."""
        for name, cap in (("max_context_tokens", max_context), ("max_generated_tokens", max_generated)):
            if cap is not None and cap < 1:
                raise ValueError(f"{name}: must be >= 1, got {cap}")
        ctx = self.context_tokens if max_context is None else np.minimum(self.context_tokens, max_context)
        gen = self.generated_tokens if max_generated is None else np.minimum(self.generated_tokens, max_generated)
        return replace(self, context_tokens=ctx, generated_tokens=gen)

    # ---- aggregation -------------------------------------------------------------------------------
    def per_interval(self, interval_s: float = 1.0) -> RequestBatches:
        """Requests grouped by arrival into consecutive intervals from t=0 (MoEless: 1 s batches)."""
        if not interval_s > 0:
            raise ValueError(f"interval_s: must be > 0, got {interval_s}")
        last_bin = int(self.arrival_s[-1] // interval_s) + 1 if self.num_requests else 0
        num = max(math.ceil(self.duration_s / interval_s - 1e-9), last_bin, 1)
        bins = np.floor(self.arrival_s / interval_s).astype(np.int64)
        offsets = np.searchsorted(bins, np.arange(num + 1), side="left").astype(np.int64)
        return RequestBatches(self, float(interval_s), offsets)

    def summary(self, interval_s: float = 1.0) -> dict[str, Any]:
        """Request rate and token statistics (the figures of MoEless Figure 10)."""
        per = self.per_interval(interval_s)
        counts = per.counts

        def dist(x: np.ndarray) -> dict[str, float]:
            if x.size == 0:
                return {}
            p = np.percentile(x, [50, 90, 99])
            return {"mean": float(x.mean()), "p50": float(p[0]), "p90": float(p[1]), "p99": float(p[2]),
                    "max": float(x.max()), "min": float(x.min())}

        return {"name": self.name, "requests": self.num_requests, "duration_s": self.duration_s,
                "interval_s": interval_s, "intervals": len(per), "empty_intervals": int((counts == 0).sum()),
                "requests_per_interval": dist(counts),
                "context_tokens": dist(self.context_tokens), "generated_tokens": dist(self.generated_tokens),
                "context_tokens_per_interval": dist(per.context_tokens),
                "generated_tokens_per_interval": dist(per.generated_tokens)}


def load_azure_trace(source: str | Path = "conv", name: Optional[str] = None) -> AzureTrace:
    """A trace from a service name ('code', 'conv': the shipped files) or a CSV path."""
    path = azure_trace_path(str(source)) if str(source) in SERVICES else Path(source)
    name = name or (str(source) if str(source) in SERVICES else path.stem)
    try:
        fh = open(path, newline="", encoding="utf-8-sig")
    except OSError as exc:
        raise WorkloadFormatError(path, f"cannot read: {exc}") from None
    with fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if header is None:
            raise WorkloadFormatError(path, "empty file, expected a header", 1)
        header = [h.strip() for h in header]
        missing = [c for c in COLUMNS if c not in header]
        if missing:
            raise WorkloadFormatError(path, f"header lacks columns {missing} (has {header})", 1)
        col = [header.index(c) for c in COLUMNS]
        stamps: list[int] = []
        ctx: list[int] = []
        gen: list[int] = []
        for row in reader:
            line = reader.line_num
            if not row or all(not f.strip() for f in row):
                continue
            if len(row) != len(header):
                raise WorkloadFormatError(path, f"expected {len(header)} fields, got {len(row)}: {row}", line)
            try:
                ts = parse_timestamp_ns(row[col[0]])
            except ValueError as exc:
                raise WorkloadFormatError(path, f"TIMESTAMP: {exc}", line) from None
            counts = []
            for name_, j, low in (("ContextTokens", col[1], 1), ("GeneratedTokens", col[2], 0)):
                try:
                    value = int(row[j])
                except ValueError:
                    raise WorkloadFormatError(path, f"{name_}: {row[j]!r} is not an integer", line) from None
                if value < low:
                    raise WorkloadFormatError(path, f"{name_}: {value} < {low}", line)
                counts.append(value)
            if stamps and ts < stamps[-1]:
                raise WorkloadFormatError(path, f"TIMESTAMP {row[col[0]].strip()} goes back in time", line)
            stamps.append(ts)
            ctx.append(counts[0])
            gen.append(counts[1])
    if not stamps:
        raise WorkloadFormatError(path, "no requests after the header")
    ns = np.asarray(stamps, dtype=np.int64)
    arrival = (ns - ns[0]).astype(np.float64) / 1e9
    return AzureTrace(name=name, source=str(path), start_ns=int(ns[0]), duration_s=float(arrival[-1]),
                      arrival_s=arrival, context_tokens=np.asarray(ctx, np.int64),
                      generated_tokens=np.asarray(gen, np.int64), request_ids=np.arange(len(ns), dtype=np.int64))
