"""Running a study's independent simulations over worker processes (one per core by default in each bench)."""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Iterator, Sequence, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


def in_workers(fn: Callable[[Item], Result], items: Sequence[Item], workers: int) -> Iterator[Result]:
    """`fn` of each item, in order, computed in `workers` processes (in this one when `workers` <= 1, which keeps
    tracebacks and profilers simple). `fn` must be a module-level function: it is pickled to the workers."""
    if workers <= 1:
        yield from map(fn, items)
        return
    with ProcessPoolExecutor(max_workers=workers) as pool:
        yield from pool.map(fn, items)
