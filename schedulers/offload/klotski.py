"""Klotski (Fang et al., 2025) in LayerScope's setting: GPU-only expert execution with its expert-aware
multi-batch pipeline. Two batches are in flight (LayerScope §5.1: "Klotski limits itself to two micro-batch
parallelism"): both go through every layer together, so an expert loaded for a layer serves both batches'
tokens, and one batch's attention runs while the experts the other needs are loading (the mechanism issues a
batch's loads at its own gate; `batches_in_flight` makes the simulator replay `batches_in_flight x batch_size`
sequences per step, each in-flight batch one micro-batch, and `engine.run` serve its workload's batches that many
at a time, each group one executor batch whose experts are called once for all its tokens). The experts the first batch needs are loaded
first, hottest first; after the layer's loads, a fixed number of the next layer's statistically hottest
experts (token counts from profiling plus everything served so far, no gate prediction: Klotski's
correlation-aware prefetcher reduced to its hot-expert part) are prefetched into the dynamic cache region.
Loads are not kept. A step yields one token for each sequence of both batches, so its decode latency is the
time of one step over both batches and its throughput counts both."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from schedulers.base import LayerPlan, LayerState, SchedulerSettings, SchedulerSetup, register
from schedulers.policy import OffloadPolicy, by_tokens, split_by_availability


@dataclass(frozen=True)
class KlotskiSettings(SchedulerSettings):
    kind: str = "klotski"
    label: str = "Klotski"
    micro_batches: int = 2  # micro-batches pipelined per layer (each in-flight batch is one)
    batches_in_flight: int = 2  # batches of `batch_size` sequences run through the layers together
    prefetch_count: int = 2  # the next layer's statistically hottest experts prefetched per layer

    @property
    def in_flight(self) -> int:
        return max(1, self.batches_in_flight)


@register("klotski", settings=KlotskiSettings)
class Klotski(OffloadPolicy):
    def __init__(self, settings: KlotskiSettings, setup: SchedulerSetup):
        super().__init__(settings, setup)
        self.counts = self.profile.astype(np.float64).copy()

    @property
    def micro_batches(self) -> int:
        return max(1, self.settings.micro_batches)

    def plan(self, state: LayerState) -> LayerPlan:
        layer, tokens = state.layer, state.tokens
        self.counts[layer] += tokens
        ready, missing = split_by_availability(state)
        if state.tokens_by_microbatch is not None:
            first = state.tokens_by_microbatch[0]
            early = by_tokens(missing[first[missing] > 0], tokens, descending=True)
            late = by_tokens(missing[first[missing] == 0], tokens, descending=True)
            loads = np.concatenate([early, late])
        else:
            loads = by_tokens(missing, tokens, descending=True)
        gpu = tuple(int(e) for e in ready) + tuple(int(e) for e in loads)
        self.touch(layer, gpu)
        prefetch: list[tuple[int, int]] = []
        target = layer + 1
        if target < state.num_layers and self.settings.prefetch_count > 0:
            avail = state.available(target)
            hot = by_tokens(np.flatnonzero(~avail), self.counts[target], descending=True)
            hot = hot[:self.settings.prefetch_count].tolist()
            prefetch = [(target, e) for e in hot]
        granted, evict = self.room_for(state, len(prefetch), {(layer, e) for e in gpu})
        prefetch = prefetch[:granted]
        for t, e in prefetch:
            self.last_used[t, e] = self._clock
        return LayerPlan(gpu=gpu, ondemand=tuple(int(e) for e in loads), prefetch=tuple(prefetch), evict=tuple(evict))
