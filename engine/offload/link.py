"""AsyncIO (LayerScope §4.4): one serial host->device link moving experts as chunked sub-transfers.

An I/O thread takes transfers in plan order (Premise 4: one expert at a time on the link). Each
expert moves as separate asynchronous writes of its gate, up and down projections, each split into
`chunks` row blocks, all dispatched before the thread waits for them (the sub-transfers of one
expert proceed together, as LayerScope's three CUDA streams). A started transfer always completes
(Premise 3); transfers not started when the next plan arrives are cancelled unless re-listed.
Completion is tracked per expert (`wait`) and reported to `on_done` (Algorithm 1's OnIoDone).

`synchronous=True` is the "no AsyncIO" ablation: pageable numpy sources, one part at a time, the
caller blocks until the expert has landed. A failed write is retried `retries` times with the
slot rewritten from scratch; after that the slot is freed and the error surfaces at `wait`.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import numpy as np

from engine.offload.cache import DeviceExpertCache
from engine.offload.store import PARTS, ExpertStore


class TransferError(RuntimeError):
    """An expert transfer that failed after its retries."""


@dataclass
class Job:
    layer: int
    expert: int
    slot: int  # -1: a staging buffer, taken when the transfer starts
    retain: bool  # lands in the cache (False: a staging buffer freed after its compute)
    prefetch: bool
    issued_at: float = field(default_factory=time.perf_counter)
    started_at: Optional[float] = None
    done_at: Optional[float] = None
    error: Optional[BaseException] = None
    attempts: int = 0
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def key(self) -> tuple[int, int]:
        return self.layer, self.expert

    @property
    def seconds(self) -> float:
        return (self.done_at or time.perf_counter()) - (self.started_at or self.issued_at)


class TransferLink:
    """The serial link between an `ExpertStore` and a `DeviceExpertCache`."""

    def __init__(self, store: ExpertStore, cache: DeviceExpertCache, chunks: int = 1, synchronous: bool = False,
                 retries: int = 2, on_done: Optional[Callable[[Job], None]] = None,
                 fault: Optional[Callable[[Job, str], None]] = None):
        if chunks < 1:
            raise ValueError(f"offload.chunks: must be >= 1, got {chunks}")
        self.store, self.cache = store, cache
        self.chunks, self.synchronous, self.retries = chunks, synchronous, retries
        self.on_done = on_done
        self.fault = fault  # test hook: called before each part's write, may raise
        self._queue: collections.deque[Job] = collections.deque()
        self._active: Optional[Job] = None
        self._jobs: dict[tuple[int, int], Job] = {}
        self._cv = threading.Condition()
        self._held = False
        self._closed = False
        self.completed: list[Job] = []
        self._thread: Optional[threading.Thread] = None
        if not synchronous:
            self._thread = threading.Thread(target=self._run, name="moescope-asyncio", daemon=True)
            self._thread.start()

    # ---- plan interface ---------------------------------------------------------------------------
    def submit(self, jobs: list[Job]) -> list[Job]:
        """Replace the not-yet-started queue by `jobs` (in order); returns the cancelled jobs (slots freed)."""
        with self._cv:
            cancelled = [j for j in self._queue]
            self._queue.clear()
            for j in cancelled:
                self._jobs.pop(j.key, None)
                if j.slot >= 0:
                    self.cache.release(j.slot)
            for j in jobs:
                self._jobs[j.key] = j
            self._queue.extend(jobs)
            self._cv.notify_all()
        return cancelled

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """A plan point: no queued transfer starts until the new plan's queue is submitted.

        The started transfer keeps going (Premise 3); what the scheduler saw as queued stays queued.
        """
        with self._cv:
            self._held = True
        try:
            yield
        finally:
            with self._cv:
                self._held = False
                self._cv.notify_all()

    def flush(self) -> None:
        """Synchronous mode: run every queued transfer now, in the caller (prefetches end inside their layer)."""
        while self.synchronous and self._queue:
            self._transfer(self._queue.popleft())

    def active(self) -> Optional[Job]:
        """The transfer on the link now (started, not finished)."""
        with self._cv:
            return self._active

    def queued(self) -> list[Job]:
        with self._cv:
            return list(self._queue)

    def pending_job(self, layer: int, expert: int) -> Optional[Job]:
        with self._cv:
            job = self._jobs.get((layer, expert))
            return job if job is not None and not job.done.is_set() else None

    def wait(self, layer: int, expert: int, timeout: float = 600.0) -> Job:
        """Block until the transfer of (layer, expert) has landed; raise TransferError if it failed."""
        with self._cv:
            job = self._jobs.get((layer, expert))
        if job is None:
            raise TransferError(f"expert ({layer}, {expert}) was never issued on the link")
        while self.synchronous and not job.done.is_set() and self._queue:
            self._transfer(self._queue.popleft())  # no AsyncIO: the caller moves everything queued before it
        if not job.done.wait(timeout):
            raise TransferError(f"expert ({layer}, {expert}) did not land within {timeout} s")
        if job.error is not None:
            raise TransferError(f"transfer of expert ({layer}, {expert}) failed after {job.attempts} attempts: "
                                f"{job.error!r}") from job.error
        return job

    def drain(self) -> None:
        """Wait for the started transfer and drop everything queued (end of a run)."""
        self.submit([])
        job = self.active()
        if job is not None:
            job.done.wait()

    def close(self) -> None:
        self.drain()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # ---- the I/O thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while (not self._queue or self._held) and not self._closed:
                    self._cv.wait()
                if self._closed and not self._queue:
                    return
                job = self._queue.popleft()
                self._active = job
            self._transfer(job)
            with self._cv:
                self._active = None

    def _transfer(self, job: Job) -> None:
        if job.slot < 0:  # an on-demand load into the staging double buffer: wait for a free one
            try:
                job.slot = self.cache.reserve_when_free(job.layer, job.expert, staging=True)
            except Exception as exc:  # noqa: BLE001 - surfaces at wait()
                job.error = exc
                job.done.set()
                return
        job.started_at = time.perf_counter()
        while True:
            job.attempts += 1
            try:
                self._move(job)
                job.error = None
                break
            except Exception as exc:  # noqa: BLE001 - any failure of the copy is retried, then surfaced
                job.error = exc
                if job.attempts > self.retries:
                    break
        job.done_at = time.perf_counter()
        if job.error is None:
            self.cache.land(job.slot)
        else:
            self.cache.release(job.slot)
        with self._cv:
            self.completed.append(job)
        job.done.set()
        if self.on_done is not None and job.error is None:
            self.on_done(job)

    def _move(self, job: Job) -> None:
        last: dict[str, object] = {}  # each write donates the previous version: wait on the newest only
        for part in PARTS:
            src = self.store.part(job.layer, job.expert, part)
            if self.synchronous:
                src = np.asarray(src)
            rows = src.shape[0]
            step = -(-rows // self.chunks)
            for row in range(0, rows, step):
                if self.fault is not None:
                    self.fault(job, part)
                out = self.cache.write(job.slot, part, src, row, min(step, rows - row))
                if self.synchronous:
                    out.block_until_ready()
                last["down" if part == "down" else "gate_up"] = out
        for out in last.values():
            out.block_until_ready()  # type: ignore[attr-defined]
