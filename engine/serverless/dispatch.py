"""How the expert-parallel layer moves rows between devices (`serverless.dispatch`).

Kept apart from `ep_layer` (jax, flax) so that the config schema of `engine.serve`, which every entry point
registers at start, names it without importing jax: `engine.simulate` and its study jobs never need jax, and
each of a multirun's worker processes would otherwise spend seconds importing it.
"""

from __future__ import annotations

import enum


class Dispatch(enum.Enum):
    auto = "auto"  # ragged where the backend has it, padded otherwise
    padded = "padded"  # all_to_all of [G, capacity, H] buffers
    ragged = "ragged"  # ragged_all_to_all (GPU/TPU; XLA:CPU leaves it unimplemented)


def resolve_dispatch(mode: Dispatch, platform: str) -> Dispatch:
    if mode is Dispatch.auto:
        return Dispatch.padded if platform == "cpu" else Dispatch.ragged
    if mode is Dispatch.ragged and platform == "cpu":
        raise ValueError("serverless.dispatch=ragged: ragged_all_to_all is not implemented on XLA:CPU; "
                         "use padded or auto")
    return mode
