"""How far an offloaded run's output is from the in-memory model's, against the width of its dtype.

In float32 the offloaded model computes what the in-memory one does (tokens equal). In bf16 the two
sum expert outputs in different orders, so logits move by a few bf16 rounding steps; the yardstick is
bf16 itself: on the same tokens (teacher forcing), the offloaded logits must be no further from the
in-memory bf16 model's than those are from the in-memory float32 model's (the "envelope"), and their
greedy choices must agree at >= 99 % of positions.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

import numpy as np

from engine.offload.executor import OffloadExecutor
from models.transformer import MoETransformer, rebuild

TOKEN_AGREEMENT = 0.99  # the least fraction of positions whose greedy choice must agree in bf16


@dataclass(frozen=True)
class Deviation:
    """Distance between two sets of logits [B, N, V] of the same positions."""

    max_abs: float  # largest |difference| over every position and vocabulary entry
    mean_abs: float  # mean over positions of the largest |difference| at that position
    argmax_agreement: float  # fraction of positions where both pick the same token
    positions: int

    @classmethod
    def between(cls, a: np.ndarray, b: np.ndarray) -> "Deviation":
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if a.shape != b.shape:
            raise ValueError(f"logits of shapes {a.shape} and {b.shape} cover different positions")
        per_position = np.abs(a - b).max(axis=-1)
        return cls(max_abs=float(per_position.max()), mean_abs=float(per_position.mean()),
                   argmax_agreement=float((a.argmax(-1) == b.argmax(-1)).mean()), positions=int(per_position.size))


def offloaded_forced_logits(executor: OffloadExecutor, prompts: Sequence[Sequence[int]], forced: np.ndarray,
                            pad_token_id: Optional[int]) -> np.ndarray:
    """Teacher-forced logits float32 [B, N, V] of an offloaded run on forced int [B, N] (see `Generator.forced_logits`)."""
    forced = np.asarray(forced, np.int32)
    out = executor.generate(prompts, forced.shape[1], pad_token_id=pad_token_id, keep_logits=True, forced=forced)
    return np.stack(out.all_logits, axis=1)


def float32_copy(model: MoETransformer) -> MoETransformer:
    """The same model in float32 (bf16 weights widened exactly): the envelope's reference."""
    return rebuild(model, np.float32)


def fidelity_report(offloaded: np.ndarray, in_memory: np.ndarray, float32: Optional[np.ndarray]) -> dict[str, Any]:
    """The offloaded logits' deviation from the in-memory model's and, given the float32 model's logits on the
    same tokens, the envelope and whether the deviation stays within it (max and mean, and >= 99 % argmax)."""
    dev = Deviation.between(offloaded, in_memory)
    report: dict[str, Any] = {"deviation": asdict(dev)}
    if float32 is None:  # a float32 run: no envelope (its tokens must simply match)
        report["within_envelope"] = None
        return report
    env = Deviation.between(in_memory, float32)
    report["envelope"] = asdict(env)
    report["within_envelope"] = bool(dev.max_abs <= env.max_abs and dev.mean_abs <= env.mean_abs
                                     and dev.argmax_agreement >= TOKEN_AGREEMENT)
    return report
