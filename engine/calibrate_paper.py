"""`python -m engine.calibrate_paper`: the simulator's free constants fitted to a named subset of LayerScope's
published figures, and the error on every other figure.

The published points are data (`engine/data/layerscope_published.yaml`: section, model, machine, batch, system,
metric, value). The free constants are `conf/calibrate_paper.yaml` `constants`: each sets one or more hardware
profile keys to one value (the same physical quantity on every machine it lists) and names the points it is
fitted on; together they use at most a third of the absolute points. The shipped profiles
(`conf/hardware/v100_pcie3.yaml`, `a100_pcie4.yaml`) hold the fitted values, each with a comment naming its
fit points.

    python -m engine.calibrate_paper              # the table for the shipped profiles (fit / held-out)
    python -m engine.calibrate_paper fit=true     # refit the constants on their fit points, then the table

Rows of the table:
- absolute: a figure the paper prints (link time, LayerScope's latency or throughput, Klotski's plateau);
- derived: a baseline's absolute figure the paper gives through a ratio to an absolute LayerScope figure at the
  same point (e.g. HybriMoE's DeepSeek V100 b4 latency = 0.37 s / (1 - 0.421));
- relative: a published speed-up (gain, latency cut, ablation loss): its direction must be right.

Every simulated point replays synthetic routing (seed list `seeds`, averaged) with the simulator's default
forecasts (`engine.sim.run.default_predictor`: the oracle degraded to the hit rates moescope's own LLaPor
measured, an upper bound on a real predictor) or, with `forecasts=<conf/predictor name>`, a real predictor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from conf import hydra_task
from core.config import CONF_DIR, resolve_path
from core.telemetry import Telemetry
from schedulers.hardware import HardwareProfile, load_hardware

ABSOLUTE_METRICS = ("t_io_ms", "decode_latency_s", "throughput_tok_s")
RELATIVE_METRICS = ("gain", "latency_cut", "ablation")


@dataclass(frozen=True)
class Point:
    """One published figure (see the header of engine/data/layerscope_published.yaml)."""

    id: str
    where: str
    model: str
    hardware: str
    batch: int
    system: str
    metric: str
    value: float
    kind: str
    evaluate: bool = True
    why: str = ""

    @property
    def at(self) -> tuple[str, str, int]:
        return self.model, self.hardware, self.batch


@dataclass(frozen=True)
class Constant:
    """A free constant: `keys` (`<hardware>:<block>.<field>`) all take `value`; fitted on `fit_points`."""

    name: str
    keys: tuple[str, ...]
    fit_points: tuple[str, ...]
    low: float
    high: float
    meaning: str = ""


def load_points(path: str | Path) -> list[Point]:
    """The published points of a YAML file; ids must be unique and kinds / metrics known."""
    data = OmegaConf.to_container(OmegaConf.load(resolve_path(path)), resolve=True)
    points = [Point(**{k: v for k, v in p.items()}) for p in data["points"]]  # type: ignore[index, union-attr]
    seen: set[str] = set()
    for p in points:
        if p.id in seen:
            raise ValueError(f"{path}: point id {p.id!r} appears twice")
        seen.add(p.id)
        if p.kind not in ("absolute", "relative", "bound"):
            raise ValueError(f"{path}: point {p.id}: kind {p.kind!r} is not absolute|relative|bound")
        if p.evaluate and p.metric not in ABSOLUTE_METRICS + RELATIVE_METRICS:
            raise ValueError(f"{path}: point {p.id}: metric {p.metric!r} cannot be evaluated (set evaluate: false)")
    return points


def constants_from(node: Any) -> list[Constant]:
    """The `constants` list of a calibrate_paper config as frozen `Constant`s."""
    out = []
    for c in node:
        c = OmegaConf.to_container(c, resolve=True) if isinstance(c, DictConfig) else dict(c)
        out.append(Constant(name=c["name"], keys=tuple(c["keys"]), fit_points=tuple(c["fit_points"]),
                            low=float(c["low"]), high=float(c["high"]), meaning=c.get("meaning", "")))
    return out


def _split_key(key: str) -> tuple[str, str, str]:
    profile, _, dotted = key.partition(":")
    block, _, attr = dotted.partition(".")
    if not (profile and block and attr):
        raise ValueError(f"constants: key {key!r} is not <hardware>:<block>.<field>")
    return profile, block, attr


def shipped_value(const: Constant, profiles: dict[str, HardwareProfile], strict: bool = True) -> float:
    """The value the shipped profiles hold for `const`: its keys must agree (`strict`; else the first key's)."""
    values = []
    for key in const.keys:
        profile, block, attr = _split_key(key)
        values.append(float(getattr(getattr(profiles[profile], block), attr)))
    if not strict:
        return values[0]
    if len(set(values)) != 1:
        raise ValueError(f"constant {const.name}: the shipped profiles disagree on {list(const.keys)}: {sorted(values)}")
    return values[0]


def apply(profiles: dict[str, HardwareProfile], constants: Sequence[Constant],
          values: dict[str, float]) -> dict[str, HardwareProfile]:
    """Copies of `profiles` with every constant's keys set to its value."""
    out = dict(profiles)
    for const in constants:
        if const.name not in values:
            continue
        for key in const.keys:
            profile, block, attr = _split_key(key)
            hw = out[profile]
            kind = type(getattr(getattr(hw, block), attr))  # float fields stay float
            new_block = replace(getattr(hw, block), **{attr: kind(values[const.name])})
            out[profile] = replace(hw, **{block: new_block})
    return out


# ---- running one point ------------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def _model(name: str):
    from models.loading import resolve_model_config

    node = OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml")
    return resolve_model_config(node), str(node.name)


@lru_cache(maxsize=None)
def _scheduler(name: str):
    from schedulers.base import scheduler_settings

    base = "presched" if name == "presched_no_async" else name
    settings = scheduler_settings(_scheduler_node(base))
    return replace(settings, label="LayerScope w/o AsyncIO") if name == "presched_no_async" else settings


def model_name(name: str) -> str:
    """The name a run of `conf/model/<name>.yaml` reports as its model."""
    return _model(name)[1]


def scheduler_label(name: str) -> str:
    """The label a run of `conf/scheduler/<name>.yaml` (or the AsyncIO ablation) reports as its system."""
    return _scheduler(name).label


def _predictor(name: str):
    """The forecasts of every run: `oracle` is the simulator's default (the replayed routing degraded to a measured
    LLaPor hit rate: an upper bound); any other name is `conf/predictor/<name>.yaml` (stats / transition are fitted
    on routing held out of the replay)."""
    from engine.sim.run import default_predictor
    from predictors.config import predictor_config

    if name == "oracle":
        return default_predictor()
    node = OmegaConf.load(CONF_DIR / "predictor" / f"{name}.yaml")
    node.pop("defaults", None)
    return predictor_config(node)


def _scheduler_node(name: str) -> DictConfig:
    """`conf/scheduler/<name>.yaml` with the scheduler files its defaults list merged under it (an ablation extends
    presched.yaml); `base_*` schemas are left to `scheduler_settings`. Hydra's compose cannot run inside this app."""
    node = OmegaConf.load(CONF_DIR / "scheduler" / f"{name}.yaml")
    merged = OmegaConf.create()
    for entry in node.pop("defaults", None) or []:
        if isinstance(entry, str) and entry != "_self_" and not entry.startswith("base_"):
            merged = OmegaConf.merge(merged, _scheduler_node(entry))
    return OmegaConf.merge(merged, node)  # type: ignore[return-value]


class Runner:
    """Simulated figures of (model, machine, batch, system), each routing prepared once per (model, batch, seed)
    and each run cached per profile values."""

    def __init__(self, seeds: Sequence[int], prompt_len: int, gen_len: int, predictor: str = "oracle"):
        self.seeds, self.prompt_len, self.gen_len = list(seeds), prompt_len, gen_len
        self.predictor = _predictor(predictor)
        self._routing: dict[tuple, Any] = {}
        self._runs: dict[tuple, dict[str, list[float]]] = {}
        self.simulated = 0

    def t_io_ms(self, model: str, hw: HardwareProfile) -> float:
        from schedulers.cost import CostModel

        return CostModel(_model(model)[0], hw).t_io * 1e3

    def run(self, model: str, hw: HardwareProfile, batch: int, system: str) -> dict[str, float]:
        """Mean throughput / decode latency over the seeds."""
        per_seed = self.per_seed(model, hw, batch, system)
        return {m: float(sum(v) / len(v)) for m, v in per_seed.items()}

    def per_seed(self, model: str, hw: HardwareProfile, batch: int, system: str) -> dict[str, list[float]]:
        """Throughput / decode latency of every seed."""
        key = (model, repr(hw), batch, system)  # profiles hold a dict (measured times): not hashable
        if key in self._runs:
            return self._runs[key]
        from engine.sim.run import RunSpec, prepare_routing, simulate

        cfg, name = _model(model)
        rows = []
        for seed in self.seeds:
            spec = RunSpec(model=cfg, model_name=name, hardware=hw, scheduler=_scheduler(system), batch_size=batch,
                           prompt_len=self.prompt_len, gen_len=self.gen_len, seed=seed,
                           async_io=system != "presched_no_async", predictor=self.predictor)
            rkey = (model, spec.sequences, seed)
            if rkey not in self._routing:
                self._routing[rkey] = prepare_routing(spec)
            rows.append(simulate(spec, self._routing[rkey]).summary)
            self.simulated += 1
        out = {m: [float(r[m]) for r in rows] for m in ("throughput_tok_s", "decode_latency_s")}
        self._runs[key] = out
        return out

    def absolute(self, p: Point, profiles: dict[str, HardwareProfile], system: Optional[str] = None) -> float:
        hw = profiles[p.hardware]
        if p.metric == "t_io_ms":
            return self.t_io_ms(p.model, hw)
        return self.run(p.model, hw, p.batch, system or p.system)[p.metric]

    def relative(self, p: Point, profiles: dict[str, HardwareProfile]) -> list[float]:
        """The simulated counterpart of a gain / latency cut / ablation loss, per seed (same routing for both)."""
        hw = profiles[p.hardware]
        ours = self.per_seed(p.model, hw, p.batch, "presched")
        theirs = self.per_seed(p.model, hw, p.batch, p.system)
        if p.metric == "gain":
            return [a / b - 1 for a, b in zip(ours["throughput_tok_s"], theirs["throughput_tok_s"])]
        if p.metric == "latency_cut":
            return [1 - a / b for a, b in zip(ours["decode_latency_s"], theirs["decode_latency_s"])]
        return [1 - b / a for a, b in zip(ours["throughput_tok_s"], theirs["throughput_tok_s"])]  # ablation


def derived_points(points: Sequence[Point]) -> list[tuple[Point, Point, float]]:
    """(relative point, LayerScope's absolute point, the baseline's absolute figure) wherever a gain / latency cut
    meets an absolute LayerScope figure of the same metric at the same (model, machine, batch)."""
    absolute = {(p.at, p.metric): p for p in points if p.kind == "absolute" and p.system == "presched"}
    out = []
    for p in points:
        if p.kind != "relative" or not p.evaluate:
            continue
        if p.metric == "latency_cut" and (p.at, "decode_latency_s") in absolute:
            ls = absolute[(p.at, "decode_latency_s")]
            out.append((p, ls, ls.value / (1 - p.value)))
        elif p.metric == "gain" and (p.at, "throughput_tok_s") in absolute:
            ls = absolute[(p.at, "throughput_tok_s")]
            out.append((p, ls, ls.value / (1 + p.value)))
    return out


# ---- fitting ----------------------------------------------------------------------------------------------------
def golden_min(f: Callable[[float], float], low: float, high: float, tolerance: float) -> float:
    """argmin of a unimodal f on [low, high], searched in log space (the constants span decades)."""
    a, b = math.log(low), math.log(high)
    g = (math.sqrt(5) - 1) / 2
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(math.exp(c)), f(math.exp(d))
    while b - a > math.log1p(tolerance):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(math.exp(c))
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(math.exp(d))
    return math.exp((a + b) / 2)


def secant_root(f: Callable[[float], float], x0: float, low: float, high: float, tolerance: float,
                max_steps: int = 12) -> float:
    """A root of a monotone f in [low, high] by the secant method in log x, from x0 (a constant's current value:
    a simulated point costs seconds, and a refit starts close). Falls back to bisection when a step leaves the
    bracket; returns the bound when f has no sign change."""
    lo, hi = math.log(low), math.log(high)
    x = (lambda u: min(max(math.exp(u), low), high))  # noqa: E731  # exp(log(high)) may round above high
    a = math.log(min(max(x0, low), high))
    fa = f(x(a))
    b = a + 0.2 if a + 0.2 <= hi else a - 0.2
    fb = f(x(b))
    for _ in range(max_steps):
        if abs(fb) < tolerance or abs(b - a) < tolerance / 10:
            break
        step = b - fb * (b - a) / (fb - fa) if fb != fa else (lo + hi) / 2
        if not lo <= step <= hi:
            step = min(max(step, lo), hi)
        a, fa, b = b, fb, step
        fb = f(x(b))
    return x(b)


def fit(runner: Runner, points: dict[str, Point], profiles: dict[str, HardwareProfile], constants: Sequence[Constant],
        start: dict[str, float], rounds: int, tolerance: float, log: Callable[[str], None] = print) -> dict[str, float]:
    """Each constant in turn matches its fit points, the others held; `rounds` passes. One fit point: the root of
    log(simulated / paper) (every constant moves its figure monotonically); several: the least squared log error
    (golden section). Returns the fitted values."""
    values = dict(start)
    for r in range(rounds):
        for const in constants:
            pts = [points[i] for i in const.fit_points]

            def errors(x: float, const: Constant = const, pts: list[Point] = pts) -> list[float]:
                trial = apply(profiles, constants, {**values, const.name: x})
                return [math.log(runner.absolute(p, trial) / p.value) for p in pts]

            if len(pts) == 1:
                values[const.name] = secant_root(lambda x: errors(x)[0], values[const.name], const.low, const.high,
                                                 tolerance)
            else:
                values[const.name] = golden_min(lambda x: sum(e * e for e in errors(x)), const.low, const.high,
                                                tolerance)
            log(f"round {r + 1}: {const.name} = {values[const.name]:.6g} (fit on {', '.join(const.fit_points)})")
    return values


# ---- the table ----------------------------------------------------------------------------------------------------
def with_variants(points: Sequence[Point], variants: dict[str, Sequence[str]]) -> list[Point]:
    """`points` plus, for every relative point of a system with variants, the same point for each variant (id
    `<id>@<variant>`, e.g. HybriMoE as LayerScope describes it, `hybrimoe_ls`)."""
    out = list(points)
    for p in points:
        if p.kind == "relative" and p.evaluate:
            out.extend(replace(p, id=f"{p.id}@{v}", system=v) for v in variants.get(p.system, ()))
    return out


def evaluate(runner: Runner, points: Sequence[Point], profiles: dict[str, HardwareProfile],
             fit_ids: set[str], only: Optional[set[str]] = None) -> list[dict[str, Any]]:
    """One row per evaluable point (absolute, derived, relative) with the simulated figure and its error; a
    variant's rows (ids with `@`) are marked `variant` and left out of the summary."""
    rows: list[dict[str, Any]] = []
    if only is not None:  # a variant follows its point
        only = only | {p.id for p in points if p.id.split("@")[0] in only}
    wanted = (lambda p: p.evaluate and (only is None or p.id in only))
    for p in points:
        if not wanted(p) or p.kind != "absolute":
            continue
        sim = runner.absolute(p, profiles)
        rows.append({"id": p.id, "where": p.where, "kind": "absolute", "role": "fit" if p.id in fit_ids else "held-out",
                     "model": p.model, "hardware": p.hardware, "batch": p.batch, "system": p.system,
                     "metric": p.metric, "paper": p.value, "simulated": sim, "error": sim / p.value - 1})
    for rel, ls, value in derived_points(points):
        if only is not None and rel.id not in only:
            continue
        metric = "decode_latency_s" if rel.metric == "latency_cut" else "throughput_tok_s"
        sim = runner.run(rel.model, profiles[rel.hardware], rel.batch, rel.system)[metric]
        rows.append({"id": f"{rel.id}:abs", "where": f"{rel.where} ({rel.id} with {ls.id})", "kind": "derived",
                     "role": "held-out", "variant": "@" in rel.id, "model": rel.model, "hardware": rel.hardware, "batch": rel.batch,
                     "system": rel.system, "metric": metric, "paper": value, "simulated": sim, "error": sim / value - 1})
    for p in points:
        if not wanted(p) or p.kind != "relative":
            continue
        per_seed = runner.relative(p, profiles)
        sim = sum(per_seed) / len(per_seed)
        std = math.sqrt(sum((x - sim) ** 2 for x in per_seed) / (len(per_seed) - 1)) if len(per_seed) > 1 else 0.0
        rows.append({"id": p.id, "where": p.where, "kind": "relative", "role": "held-out", "variant": "@" in p.id,
                     "model": p.model,
                     "hardware": p.hardware, "batch": p.batch, "system": p.system, "metric": p.metric,
                     "paper": p.value, "simulated": sim, "std": std, "per_seed": per_seed,
                     "direction_ok": (sim > 0) == (p.value > 0)})
    return rows


def summarize(rows: Sequence[dict[str, Any]], limit: float) -> dict[str, Any]:
    """Counts against the goal: held-out absolute / derived figures within `limit`, relative directions right."""
    rows = [r for r in rows if not r.get("variant")]
    held = [r for r in rows if r["role"] == "held-out" and r["kind"] in ("absolute", "derived")]
    out: dict[str, Any] = {}
    for kind in ("absolute", "derived"):
        group = [r for r in held if r["kind"] == kind]
        out[f"held_out_{kind}"] = len(group)
        out[f"held_out_{kind}_within_limit"] = sum(abs(r["error"]) <= limit for r in group)
        out[f"held_out_{kind}_max_abs_error"] = max((abs(r["error"]) for r in group), default=float("nan"))
        out[f"held_out_{kind}_outside"] = [r["id"] for r in group if abs(r["error"]) > limit]
    fit_rows = [r for r in rows if r["role"] == "fit"]
    out["fit_points"] = len(fit_rows)
    out["fit_max_abs_error"] = max((abs(r["error"]) for r in fit_rows), default=float("nan"))
    rel = [r for r in rows if r["kind"] == "relative"]
    out["relative"] = len(rel)
    out["relative_direction_right"] = sum(r["direction_ok"] for r in rel)
    out["relative_direction_wrong"] = [r["id"] for r in rel if not r["direction_ok"]]
    return out


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The fitted-vs-held-out table as Markdown."""
    lines = ["| point | kind | role | system | metric | paper | simulated | error / direction |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r["kind"] == "relative":
            verdict = "right" if r["direction_ok"] else "**wrong**"
            spread = f" ± {r['std']:.1%}" if r.get("std") else ""
            err = f"{r['simulated']:+.1%}{spread} vs {r['paper']:+.1%}: {verdict}"
            paper, sim = f"{r['paper']:+.3f}", f"{r['simulated']:+.3f}"
        else:
            paper, sim = f"{r['paper']:.4g}", f"{r['simulated']:.4g}"
            err = f"{r['error']:+.1%}"
        lines.append(f"| {r['id']} | {r['kind']} | {r['role']} | {r['system']} | {r['metric']} | {paper} | {sim} | {err} |")
    return "\n".join(lines)


def check_fit_budget(points: Sequence[Point], constants: Sequence[Constant]) -> tuple[int, int]:
    """(fit points, absolute points); raises if a fit point is unknown or not absolute, or if the fit points
    are more than a third of the absolute points."""
    by_id = {p.id: p for p in points}
    fit_ids = {i for c in constants for i in c.fit_points}
    for i in sorted(fit_ids):
        if i not in by_id:
            raise ValueError(f"constants: fit point {i!r} is not in the published points")
        if by_id[i].kind != "absolute" or not by_id[i].evaluate:
            raise ValueError(f"constants: fit point {i!r} is not an evaluable absolute figure")
    n_abs = sum(1 for p in points if p.kind == "absolute" and p.evaluate)
    if 3 * len(fit_ids) > n_abs:
        raise ValueError(f"constants: {len(fit_ids)} fit points of {n_abs} absolute figures (at most a third)")
    return len(fit_ids), n_abs


def headline(results: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in results["summary"].items() if not isinstance(v, list)} | \
        {f"const.{c['name']}": c["value"] for c in results["constants"]}


@hydra_task("calibrate_paper", summarize=headline)
def main(cfg: DictConfig, tm: Telemetry) -> dict[str, Any]:
    published = OmegaConf.load(resolve_path(cfg.published))
    points = load_points(cfg.published)
    by_id = {p.id: p for p in points}
    constants = constants_from(cfg.constants)
    n_fit, n_abs = check_fit_budget(points, constants)
    names = sorted({_split_key(k)[0] for c in constants for k in c.keys} | {p.hardware for p in points
                                                                         if p.evaluate and p.hardware != "any"})
    profiles = {n: load_hardware(n) for n in names}
    shipped = {c.name: shipped_value(c, profiles, strict=not cfg.fit) for c in constants}
    runner = Runner(cfg.seeds, int(published.prompt_len), int(published.gen_len), str(cfg.forecasts))
    values = shipped
    if cfg.fit:
        values = fit(runner, by_id, profiles, constants, shipped, int(cfg.rounds), float(cfg.tolerance))
    profiles = apply(profiles, constants, values)
    fit_ids = {i for c in constants for i in c.fit_points}
    variants = {str(k): [str(v) for v in vs] for k, vs in cfg.variants.items()}
    rows = evaluate(runner, with_variants(points, variants), profiles, fit_ids, set(cfg.points) if cfg.points else None)
    summary = summarize(rows, float(cfg.limit))
    table = format_table(rows)
    print(table)
    (tm.run_dir / "table.md").write_text(table + "\n")
    return {"published": str(cfg.published), "fit": bool(cfg.fit), "seeds": list(cfg.seeds),
            "forecasts": str(cfg.forecasts), "routing": "synthetic (engine.synthetic_routing defaults)",
            "fit_points_used": n_fit, "absolute_points": n_abs,
            "constants": [{"name": c.name, "value": values[c.name], "shipped": shipped[c.name], "keys": list(c.keys),
                           "fit_points": list(c.fit_points), "meaning": c.meaning} for c in constants],
            "rows": rows, "summary": summary, "simulated_runs": runner.simulated}


if __name__ == "__main__":
    main()
