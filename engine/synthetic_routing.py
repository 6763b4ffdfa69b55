"""Synthetic MoE routing with the structure real routers show (LayerScope §3.1, MoEless §2).

Four mechanisms, each set per layer group (input / middle / output MoE layers):

- **popularity skew** (`popularity_sigma`): layer l draws fresh experts from a fixed popularity
  vector p_l = softmax(sigma * z_l), z_l ~ N(0, 1) per expert. sigma = 0 is uniform routing;
  sigma = 1 gives a per-layer load coefficient of variation around 1 (hot experts).
- **inter-layer correlation** (`layer_correlation`): with this probability a token's k-th expert at
  layer l follows a fixed affinity map pi_l(expert at l-1) (a permutation), the ExFlow-style
  "token keeps its path" effect that makes layer l predictable from layer l-1.
- **temporal locality** (`temporal_locality`): with this probability a token's k-th expert repeats
  the one the same sequence used at the same layer one position earlier (previous prompt position
  in prefill, previous decode step in decode).
- **request domains** (`num_domains`, per group `domain_sigma`): each request belongs to one of
  `num_domains` equally likely domains (topics: code, chat, maths, ...) and draws its fresh experts
  from its domain's popularity softmax(sigma * z_l + domain_sigma * u_{l,d}), u ~ N(0, 1) per
  domain and expert. Experts specialise by domain in trained MoEs (OLMoE's routing analysis), so
  the load of a batch depends on which requests it holds: the time-varying expert demand of MoEless
  §2.3 (Fig. 3c). One domain (the default) makes every batch draw from the same distribution.

Duplicates within a token's top-k are redrawn from p_l; routing weights are u ** (1 / c) for
uniform u and c = `weight_concentration`, sorted and normalised (small c: one dominant expert).

The *model* (popularity vectors, affinity maps) is fixed by `model_seed`; the *traffic* (which
tokens go where) by the seed of each call, so profiling runs and served batches share hot experts.

Defaults (`SyntheticRoutingParams`) are fitted to real Mixtral-8x7B routing (vLLM logs, 32 layers,
top-2 of 8; the figures of issue 20): per-layer load CV 0.22 on average (0.06-0.34 across layers),
layer l -> l+1 top-2 predictability of a transition table 0.35-0.40, of the frequency baseline
0.26-0.31 (random: 0.25). Fit: a grid over (popularity_sigma, layer_correlation), the same in every
group, on model seeds 0-1 and traffic seed 1 of a 32-layer top-2-of-8 router (4 batches of 16
prompts x 64 tokens + 31 decode steps), measured with `core.routing_stats.routing_report`;
`python -m engine.bench.fit_synthetic_routing` reruns it and measures held-out seeds (README table).
CV and the frequency baseline move together under log-normal popularity, so the fit takes the CV and
the transition figure and lands the frequency baseline at ~0.31, the top of its range. Temporal
locality (0.3) and the weight concentrations are not constrained by these figures and are kept.
`conf/routing/domains.yaml` (the serve default) is fitted the same way with 8 request domains;
`conf/routing/trained_tiny.yaml` to the shipped mixtral-tiny's recorded routing;
`conf/routing/layerscope_fig2.yaml` keeps the earlier unfitted defaults (LayerScope Figure 2's
qualitative pattern, CV 0.44, transition 0.47).

    router = SyntheticRouter.for_model(cfg, SyntheticRoutingParams(), model_seed=0)
    trace = router.trace(batch=16, prompt_len=512, gen_len=64, seed=1)  # a RoutingTrace
    experts, weights = router.prefill(num_seqs=4, prompt_len=8, rng)    # [L, T, k] arrays
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from core.trace import DECODE, PREFILL, RoutingTrace, TraceMeta, TraceRecorder

_LUT_SIZE = 1 << 16


@dataclass(frozen=True)
class LayerGroupParams:
    popularity_sigma: float = 0.8  # spread of log-popularity across experts (0 = uniform)
    layer_correlation: float = 0.3  # P(k-th expert follows the affinity map of the previous layer's k-th expert)
    temporal_locality: float = 0.3  # P(k-th expert repeats the previous position's / step's)
    weight_concentration: float = 1.0  # evenness of the top-k weights (small: one dominant expert)
    domain_sigma: float = 0.0  # spread of each request domain's log-popularity offset (needs num_domains > 1)

    def validate(self, where: str) -> None:
        for key in ("layer_correlation", "temporal_locality"):
            value = getattr(self, key)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{where}.{key}: must lie in [0, 1], got {value}")
        for key in ("popularity_sigma", "domain_sigma"):
            if getattr(self, key) < 0:
                raise ValueError(f"{where}.{key}: must be >= 0, got {getattr(self, key)}")
        if self.weight_concentration <= 0:
            raise ValueError(f"{where}.weight_concentration: must be > 0, got {self.weight_concentration}")


@dataclass(frozen=True)
class SyntheticRoutingParams:
    """Per-group routing statistics. `input_fraction` / `output_fraction` of the MoE layers form the
    input and output groups (at least one layer each when there are three or more layers);
    `num_domains` request domains share the traffic (1: routing independent of the request)."""

    input_fraction: float = 0.25
    output_fraction: float = 0.25
    num_domains: int = 1
    # popularity_sigma 0.35 / layer_correlation 0.3 fitted to Mixtral-8x7B's CV 0.22 and transition 0.35-0.40 (module doc)
    input: LayerGroupParams = field(default_factory=lambda: LayerGroupParams(
        popularity_sigma=0.35, layer_correlation=0.3, temporal_locality=0.3, weight_concentration=0.5))
    middle: LayerGroupParams = field(default_factory=lambda: LayerGroupParams(
        popularity_sigma=0.35, layer_correlation=0.3, temporal_locality=0.3, weight_concentration=2.0))
    output: LayerGroupParams = field(default_factory=lambda: LayerGroupParams(
        popularity_sigma=0.35, layer_correlation=0.3, temporal_locality=0.3, weight_concentration=0.5))

    def validate(self) -> None:
        for key in ("input_fraction", "output_fraction"):
            value = getattr(self, key)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"routing.synthetic.{key}: must lie in [0, 1], got {value}")
        if self.num_domains < 1:
            raise ValueError(f"routing.synthetic.num_domains: must be >= 1, got {self.num_domains}")
        if self.input_fraction + self.output_fraction > 1.0:
            raise ValueError("routing.synthetic: input_fraction + output_fraction exceeds 1")
        for name in ("input", "middle", "output"):
            getattr(self, name).validate(f"routing.synthetic.{name}")

    def group_of_layers(self, num_layers: int) -> list[str]:
        """The group name ('input', 'middle', 'output') of each MoE layer."""
        n_in = int(round(self.input_fraction * num_layers))
        n_out = int(round(self.output_fraction * num_layers))
        if num_layers >= 3:
            n_in = max(n_in, 1) if self.input_fraction > 0 else 0
            n_out = max(n_out, 1) if self.output_fraction > 0 else 0
        n_in = min(n_in, num_layers)
        n_out = min(n_out, num_layers - n_in)
        return ["input"] * n_in + ["middle"] * (num_layers - n_in - n_out) + ["output"] * n_out


class SyntheticRouter:
    """A fixed synthetic "model" (popularity and affinity per layer) that routes token batches."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int, params: Optional[SyntheticRoutingParams] = None,
                 model_seed: int = 0, moe_layers: Optional[tuple[int, ...]] = None, model_name: str = "synthetic"):
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"synthetic routing: top_k={top_k} must lie in [1, num_experts={num_experts}]")
        self.params = params or SyntheticRoutingParams()
        self.params.validate()
        self.L, self.E, self.k = num_layers, num_experts, top_k
        self.moe_layers = tuple(moe_layers) if moe_layers is not None else tuple(range(num_layers))
        self.model_name = model_name
        self.groups = self.params.group_of_layers(num_layers)
        self.layer_params = [getattr(self.params, g) for g in self.groups]
        rng = np.random.default_rng(model_seed)
        logits = np.stack([gp.popularity_sigma * rng.standard_normal(num_experts) for gp in self.layer_params])  # [L, E]
        self.affinity = np.stack([rng.permutation(num_experts) for _ in range(num_layers)])  # [L, E]
        self.num_domains = self.params.num_domains
        if self.num_domains > 1:  # drawn after the affinity maps: one domain keeps the model of older seeds
            spread = np.array([gp.domain_sigma for gp in self.layer_params])[:, None, None]
            logits = logits[:, None, :] + spread * rng.standard_normal((num_layers, self.num_domains, num_experts))
        else:
            logits = logits[:, None, :]
        p = np.exp(logits - logits.max(axis=-1, keepdims=True))
        self.domain_popularity = p / p.sum(axis=-1, keepdims=True)  # [L, D, E]
        self.popularity = self.domain_popularity.mean(axis=1)  # [L, E]: over the uniform domain mix
        cdf = np.cumsum(self.domain_popularity, axis=-1)
        cdf[..., -1] = 1.0
        # inverse-CDF lookup table: expert of each of 2**16 equal probability bins (bin error <= 1.5e-5)
        grid = (np.arange(_LUT_SIZE) + 0.5) / _LUT_SIZE
        self._lut = np.stack([[np.searchsorted(c, grid, side="right") for c in layer_cdf] for layer_cdf in cdf]
                             ).clip(0, num_experts - 1).astype(np.int16)  # [L, D, LUT]

    @classmethod
    def for_model(cls, cfg, params: Optional[SyntheticRoutingParams] = None, model_seed: int = 0,
                  model_name: str = "") -> "SyntheticRouter":
        """A router with a `ModelConfig`'s MoE layers, expert count and top-k."""
        return cls(len(cfg.moe_layers), cfg.num_experts, cfg.num_experts_per_tok, params, model_seed,
                   moe_layers=cfg.moe_layers, model_name=model_name or cfg.family.value)

    # ---- sampling ------------------------------------------------------------------------------
    def request_domains(self, num_seqs: int, rng: np.random.Generator) -> Optional[np.ndarray]:
        """Each request's domain, int [num_seqs] (None with one domain: nothing is drawn)."""
        return rng.integers(0, self.num_domains, size=num_seqs) if self.num_domains > 1 else None

    def _popular(self, layer: int, n: int, rng: np.random.Generator, domain: Optional[np.ndarray] = None) -> np.ndarray:
        """n experts drawn from the layer's popularity (of each draw's `domain` [n], if given)."""
        bins = rng.integers(0, _LUT_SIZE, size=n)
        return self._lut[layer, 0][bins] if domain is None else self._lut[layer][domain, bins]

    def _dedupe(self, layer: int, ex: np.ndarray, rng: np.random.Generator,
                domain: Optional[np.ndarray] = None) -> np.ndarray:
        """Redraw duplicated experts within each token from the layer's popularity until distinct."""
        if self.k == 1:
            return ex
        srt = np.sort(ex, axis=1)
        rows = np.flatnonzero((srt[:, 1:] == srt[:, :-1]).any(axis=1))
        sub = ex[rows]
        sub_domain = None if domain is None else np.broadcast_to(domain[rows][:, None], sub.shape)
        for _ in range(1000):
            if sub.shape[0] == 0:
                return ex
            order = np.argsort(sub, axis=1, kind="stable")
            srt = np.take_along_axis(sub, order, axis=1)
            later = np.zeros(sub.shape, dtype=bool)
            later[:, 1:] = srt[:, 1:] == srt[:, :-1]  # every repeat after its first occurrence
            dup = np.zeros(sub.shape, dtype=bool)
            np.put_along_axis(dup, order, later, axis=1)
            n = int(dup.sum())
            if n == 0:
                ex[rows] = sub
                return ex
            sub[dup] = self._popular(layer, n, rng, None if sub_domain is None else sub_domain[dup])
        # pathological popularity (all mass on fewer than k experts): fill with unused experts
        for t in range(sub.shape[0]):
            used = set(sub[t].tolist())
            unused = [e for e in range(self.E) if e not in used]
            seen: set[int] = set()
            for j in range(self.k):
                if int(sub[t, j]) in seen:
                    sub[t, j] = unused.pop(0)
                seen.add(int(sub[t, j]))
        ex[rows] = sub
        return ex

    def _weights(self, layer: int, n: int, rng: np.random.Generator) -> np.ndarray:
        # u ** (1 / c), sorted and normalised: small c concentrates the weight on the first expert
        g = rng.random((n, self.k), dtype=np.float32) ** (1.0 / self.layer_params[layer].weight_concentration) + 1e-6
        w = -np.sort(-g, axis=1)
        return w / w.sum(axis=1, keepdims=True)

    def _route(self, previous_position: Optional[np.ndarray], chain_start: Optional[np.ndarray], n: int,
               rng: np.random.Generator, domain: Optional[np.ndarray] = None) -> tuple[np.ndarray, np.ndarray]:
        """Route n tokens through every layer.

        previous_position: int [L, n, k] experts of each token's previous position (decode), or None.
        chain_start: bool [n] in prefill: True where a token starts its sequence (rows of a sequence
        are contiguous); temporal locality then copies along each sequence.
        domain: int [n] each token's request domain (None: one domain).
        """
        draw_domain = None if domain is None else np.repeat(domain, self.k)
        experts = np.empty((self.L, n, self.k), dtype=np.int16)
        weights = np.empty((self.L, n, self.k), dtype=np.float32)
        prev_layer: Optional[np.ndarray] = None
        idx = np.arange(n)
        for layer, gp in enumerate(self.layer_params):
            ex = self._popular(layer, n * self.k, rng, draw_domain).reshape(n, self.k)
            if prev_layer is not None and gp.layer_correlation > 0:
                follow = rng.random((n, self.k)) < gp.layer_correlation
                ex = np.where(follow, self.affinity[layer][prev_layer], ex)
            if gp.temporal_locality > 0:
                copy = rng.random((n, self.k)) < gp.temporal_locality
                if previous_position is not None:
                    ex = np.where(copy, previous_position[layer], ex)
                elif chain_start is not None:
                    for j in range(self.k):
                        fresh = ~copy[:, j] | chain_start
                        src = np.maximum.accumulate(np.where(fresh, idx, 0))
                        ex[:, j] = ex[src, j]
            ex = self._dedupe(layer, ex, rng, domain)
            experts[layer] = ex
            weights[layer] = self._weights(layer, n, rng)
            prev_layer = ex.astype(np.int64)
        return experts, weights

    def _domains(self, domains: Optional[np.ndarray], num_seqs: int, rng: np.random.Generator) -> Optional[np.ndarray]:
        if domains is None:
            return self.request_domains(num_seqs, rng)
        domains = np.asarray(domains, dtype=np.int64)
        if domains.shape != (num_seqs,) or (domains.size and not 0 <= domains.min() <= domains.max() < self.num_domains):
            raise ValueError(f"synthetic routing: domains must be {num_seqs} ints in [0, num_domains={self.num_domains}), "
                             f"got shape {domains.shape}")
        return domains if self.num_domains > 1 else None

    def prefill(self, num_seqs: int, prompt_len: int, rng: np.random.Generator,
                domains: Optional[np.ndarray] = None) -> tuple[np.ndarray, np.ndarray]:
        """Routing of `num_seqs` prompts of `prompt_len` tokens: int16 [L, S*P, k], float32 [L, S*P, k]
        (rows sequence-major). `domains` [S]: each prompt's request domain (drawn when not given)."""
        n = num_seqs * prompt_len
        starts = np.zeros(n, dtype=bool)
        starts[::prompt_len] = True
        domains = self._domains(domains, num_seqs, rng)
        return self._route(None, starts, n, rng, None if domains is None else np.repeat(domains, prompt_len))

    def decode(self, previous: np.ndarray, rng: np.random.Generator,
               domains: Optional[np.ndarray] = None) -> tuple[np.ndarray, np.ndarray]:
        """One decode step for the sequences whose previous-position routing is `previous` [L, S, k];
        `domains` [S]: their request domains (pass the prefill's; drawn afresh when not given)."""
        if previous.shape[0] != self.L or previous.shape[2] != self.k:
            raise ValueError(f"decode: previous routing has shape {previous.shape}, expected (L={self.L}, S, k={self.k})")
        domains = self._domains(domains, previous.shape[1], rng)
        return self._route(previous.astype(np.int64), None, previous.shape[1], rng, domains)

    def trace(self, batch: int, prompt_len: int, gen_len: int, seed: int = 0, num_batches: int = 1,
              source: str = "synthetic") -> RoutingTrace:
        """A `RoutingTrace` of `num_batches` batches: each a prefill of `batch` prompts of
        `prompt_len` tokens, then `gen_len - 1` decode steps (the prefill yields the first token)."""
        if batch < 1 or prompt_len < 1 or gen_len < 1:
            raise ValueError(f"synthetic trace: batch={batch}, prompt_len={prompt_len}, gen_len={gen_len} must be >= 1")
        rng = np.random.default_rng(seed)
        meta = TraceMeta(model=self.model_name, num_experts=self.E, top_k=self.k, moe_layers=self.moe_layers,
                         source=source, extra={"generator": "engine.synthetic_routing"})
        rec = TraceRecorder(meta)
        for b in range(num_batches):
            seq = np.arange(batch) + b * batch
            domains = self.request_domains(batch, rng)
            ex, w = self.prefill(batch, prompt_len, rng, domains)
            rec.add_step(list(ex), list(w), seq=np.repeat(seq, prompt_len), pos=np.tile(np.arange(prompt_len), batch),
                         phase=PREFILL)
            last = ex[:, prompt_len - 1::prompt_len]
            for s in range(gen_len - 1):
                last, w = self.decode(last, rng, domains)
                rec.add_step(list(last), list(w), seq=seq, pos=np.full(batch, prompt_len + s), phase=DECODE)
        return rec.build()


def synthetic_trace(cfg, batch: int, prompt_len: int, gen_len: int, *, params: Optional[SyntheticRoutingParams] = None,
                    model_seed: int = 0, seed: int = 0, num_batches: int = 1, model_name: str = "") -> RoutingTrace:
    """One-call form of `SyntheticRouter.for_model(cfg, ...).trace(...)`."""
    router = SyntheticRouter.for_model(cfg, params, model_seed=model_seed, model_name=model_name)
    return router.trace(batch, prompt_len, gen_len, seed=seed, num_batches=num_batches)


__all__ = ["LayerGroupParams", "SyntheticRoutingParams", "SyntheticRouter", "synthetic_trace"]
