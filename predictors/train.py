"""`python -m predictors.train` (`moescope-train-predictors`): train expert predictors and evaluate them.

    python -m predictors.train model=mixtral_tiny
    python -m predictors.train model=deepseek_tiny trace=<sharegpt.npz> shift_trace=<code.npz>
    python -m predictors.train predictor=llapor predictor.train.epochs=10 'baselines={}'
    python -m predictors.train resume=runs/predictors_train/<run>     # continue an interrupted run

1. Routing traces with gate inputs: loaded (`trace`, `shift_trace`: a .npz trace or a vLLM .jsonl routing
   log) or recorded with the model on `workload` (in-distribution) and `shift_workload` (code, the shifted
   set). A trace without gate inputs (a JSONL log) trains the routing-only methods (stats, transition); the
   others are skipped, named in results.json's `skipped` (the headline predictor must be routing-only then).
2. In-distribution sequences split into train / validation / test (by sequence, never by token);
   layer groups found on the training rows (or set in `predictor.llapor.groups`).
3. The headline `predictor` and every entry of `baselines` trained (gate and MoEless at each of
   `distances`), saved as orbax predictor folders under `out` (default <run dir>/predictors). Every
   learned layer checkpoints every `checkpoint_every` epochs under <run dir>/checkpoints/<method>/layer<t>/;
   `resume` continues an interrupted run from there (`predictors.fitting.fit`), on its saved traces.
4. Every method scored per target layer and layer group (top-k hit rate, hot Top-4 within true
   Top-6, token coverage, load Pearson correlation, load accuracy) on the test sequences and the
   shifted trace; the headline predictor also streamed through both with online fine-tuning.
5. results.json, figures, a summary table, wandb.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
from omegaconf import DictConfig, OmegaConf
from rich.table import Table

from core.config import resolve_path
from conf import hydra_task
from predictors.config import ROUTING_ONLY, PredictorConfig, PredictorKind
from conf.schemas.predictors_train import PredictorsTrainConfig
from core.telemetry import Telemetry, console
from core.trace import RoutingTrace
from engine.record import obtain_trace
from models.checkpointing import run_checkpoints, saved_steps
from models.config import ModelConfig
from predictors.checkpoint import load_predictor_folder, save_predictor
from predictors.common import TrainedPredictor
from predictors.data import Split, split_rows
from predictors.evaluate import evaluate_offline, evaluate_online
from predictors.factory import load_predictor
from predictors.fitting import Checkpoints, scoped
from predictors.gate import GatePredictor, gate_copies
from predictors.groups import LayerGroups, groups_from_spec, layer_groups
from predictors.llapor import LLaPorPredictor, fit_llapor
from predictors.moeless import fit_moeless
from predictors.plots import accuracy_figure, distance_figure, load_correlation_figure, online_figure
from predictors.stats import StatsPredictor
from predictors.token import fit_token
from predictors.transition import TransitionPredictor
from models.loading import load_model, resolve_model_config

SETS = ("test", "shift")


@dataclass
class TrainData:
    """Everything the predictors are fitted from."""

    trace: RoutingTrace
    split: Split
    groups: LayerGroups
    model_cfg: ModelConfig
    kernels: list[np.ndarray]
    biases: list[np.ndarray]
    embedding: np.ndarray
    progress: Optional[Callable] = None
    checkpoints: Optional[Checkpoints] = None  # <run dir>/checkpoints: one folder per method (and distance)


# ---- traces ---------------------------------------------------------------------------------------------------
def check_trace(trace: RoutingTrace, model_cfg: ModelConfig, where: str, need_hidden: bool = True) -> None:
    """The trace must come from this model's architecture and, for methods that read them, carry gate inputs."""
    meta = trace.meta
    want = (model_cfg.num_experts, model_cfg.num_experts_per_tok, tuple(model_cfg.moe_layers))
    if (meta.num_experts, meta.top_k, tuple(meta.moe_layers)) != want:
        raise ValueError(f"{where}: trace of {meta.num_experts} experts top-{meta.top_k}, MoE layers {list(meta.moe_layers)}; "
                         f"the model has {want[0]} experts top-{want[1]}, MoE layers {list(want[2])}")
    if trace.hidden is None:
        if need_hidden:
            raise ValueError(f"{where}: the trace has no hidden states (record it with keep_hidden=true)")
        return
    if trace.hidden.shape[2] != model_cfg.hidden_size:
        raise ValueError(f"{where}: hidden size {trace.hidden.shape[2]} != the model's {model_cfg.hidden_size}")


def training_trace(path: Optional[str], workload: Any, cfg: PredictorsTrainConfig, tm: Telemetry,
                   save_as: str, num_experts: int) -> RoutingTrace:
    """The trace at `path` (.npz or a vLLM .jsonl log), or a recording of the model serving `workload`, saved into
    the run folder as `save_as` when `save_traces`. `workload`: a `WorkloadConfig`."""
    trace = obtain_trace(path, cfg.model, workload, fmt=cfg.trace_format, num_experts=num_experts,
                         drop_incomplete=cfg.drop_incomplete, phase=cfg.phase, dtype=cfg.dtype.value, seed=cfg.seed,
                         progress=tm.progress)
    if not path and cfg.save_traces:
        trace.save(tm.run_dir / save_as)
    return trace


def shift_recording_skipped(cfg: PredictorsTrainConfig, trace_path: Optional[str], shift_path: Optional[str],
                            reads_hidden: bool) -> Optional[str]:
    """Why the shifted set is not recorded, or None: a run on a `trace` file whose methods read routing alone needs
    no model, and recording `shift_workload` would build the whole model (Mixtral-8x7B: 47B parameters) for it."""
    if not cfg.shift or shift_path or not trace_path or reads_hidden:
        return None
    return (f"trace={trace_path} trains routing-only methods, which need no model; recording shift_workload would "
            "build it (set shift_trace=<file> to evaluate on a shifted set, or shift=false)")


# ---- checkpoints --------------------------------------------------------------------------------------------------
def training_checkpoints(cfg: PredictorsTrainConfig, run_dir: Path) -> Optional[Checkpoints]:
    """Where learned layers checkpoint (<run dir>/checkpoints) and the interrupted run they resume from, if any.

    `resume`: a run folder or its checkpoints/; true: this run's own folder (a fixed hydra.run.dir). Checked
    before any trace is recorded, so a wrong folder fails in a second, not after the recording."""
    if cfg.checkpoint_every < 0 or cfg.keep_checkpoints < 1:
        raise ValueError(f"checkpoint_every={cfg.checkpoint_every} (>= 0) / keep_checkpoints={cfg.keep_checkpoints} "
                         "(>= 1) out of range")
    own = run_dir / "checkpoints"
    resume = None
    if cfg.resume is not None:
        in_place = str(cfg.resume).lower() == "true"  # OmegaConf hands `resume=true` over as 'True'
        resume = own if in_place else run_checkpoints(resolve_path(cfg.resume))
        if not any(saved_steps(layer) for layer in resume.glob("*/layer*")):
            value = "true" if in_place else cfg.resume
            raise FileNotFoundError(f"resume={value}: no predictor training checkpoint under {resume} "
                                    "(expected <method>/layer<t>/<epoch>/ written by predictors.train)")
    if cfg.checkpoint_every == 0 and resume is None:
        return None
    return Checkpoints(folder=own, every=cfg.checkpoint_every, keep=cfg.keep_checkpoints, resume=resume)


def resumed_trace(checkpoints: Optional[Checkpoints], name: str) -> Optional[str]:
    """The interrupted run's recorded trace `name`, if it saved one: its finished layers were trained on it (a
    re-recording need not be bit-identical off CPU)."""
    if checkpoints is None or checkpoints.resume is None or checkpoints.resume.name != "checkpoints":
        return None
    path = checkpoints.resume.parent / name
    return str(path) if path.is_file() else None


# ---- training ---------------------------------------------------------------------------------------------------
def method_configs(cfg: PredictorsTrainConfig) -> dict[str, PredictorConfig]:
    """The headline predictor first, then the baselines (one of the headline's name is dropped)."""
    out = {cfg.predictor.name: cfg.predictor}
    for key, base in cfg.baselines.items():
        if base.name in out:
            continue
        out[base.name] = base
    return out


def multi_distance(kind: PredictorKind) -> bool:
    return kind in (PredictorKind.gate, PredictorKind.moeless)


def train_method(pcfg: PredictorConfig, data: TrainData, distances: list[int]) -> tuple[dict[str, TrainedPredictor], dict]:
    """Fit one configured method; returns predictors by result key ('llapor', 'moeless@d2', ...) and training notes."""
    tr, split, L = data.trace, data.split, data.trace.num_layers
    kind = pcfg.kind
    ds = [d for d in distances if 1 <= d < L] if multi_distance(kind) else [pcfg.distance]

    def key(d: int) -> str:
        return f"{pcfg.name}@d{d}" if multi_distance(kind) else pcfg.name

    preds: dict[str, TrainedPredictor] = {}
    notes: dict[str, Any] = {}
    for d in ds:
        c = replace(pcfg, distance=d)
        ckpt = scoped(data.checkpoints, key(d).replace("@", "_"))  # named like the predictor folder
        if kind is PredictorKind.stats:
            preds[key(d)] = StatsPredictor.fit(tr, split.train, c.name, d, c.stats.online)
        elif kind is PredictorKind.transition:
            preds[key(d)] = TransitionPredictor.fit(tr, split.train, c.name, d)
        elif kind is PredictorKind.gate:
            preds[key(d)] = GatePredictor(key(d), d, data.model_cfg, {j: data.kernels[j] for j in range(d, L)},
                                          {j: data.biases[j] for j in range(d, L)})
        elif kind is PredictorKind.token:
            preds[key(d)], losses = fit_token(tr, split.train, c, data.embedding, progress=data.progress,
                                              checkpoints=ckpt)
            notes[key(d)] = {"final_loss": {t: v[-1] for t, v in losses.items()}}
        elif kind is PredictorKind.llapor:
            preds[key(d)], losses = fit_llapor(tr, split.train, c, data.groups, progress=data.progress,
                                               checkpoints=ckpt)
            notes[key(d)] = {"final_loss": {t: v[-1] for t, v in losses.items()},
                             "pca_dims": {t: int(preds[key(d)].layers[t].comps.shape[1]) for t in preds[key(d)].targets}}
        elif kind is PredictorKind.moeless:
            pred = fit_moeless(tr, split.train, split.val, c, data.model_cfg, data.kernels, data.biases, key(d),
                               progress=data.progress, checkpoints=ckpt)
            preds[key(d)] = pred
            notes[key(d)] = {"profile": pred.profile,
                             "tuned_layers": [t for t, r in pred.profile.items() if r["tuned"]]}
        else:
            raise ValueError(f"predictor.kind={kind.value}: nothing to train")
    return preds, notes


# ---- evaluation ---------------------------------------------------------------------------------------------------
def evaluation_sets(trace: RoutingTrace, split: Split, shift: Optional[RoutingTrace]) -> dict[str, tuple[RoutingTrace, np.ndarray]]:
    sets = {"test": (trace, split.test)}
    if shift is not None:
        sets["shift"] = (shift, np.ones(shift.num_rows, bool))
    return sets


def headline_online(folder: Path, sets: dict, groups: dict, cfg: PredictorsTrainConfig, progress: Any) -> dict:
    """Stream each set through a fresh copy of the saved headline predictor with online fine-tuning on."""
    out = {}
    for which, (trace, rows) in sets.items():
        pred = load_predictor_folder(folder)
        assert isinstance(pred, LLaPorPredictor)
        t0 = time.perf_counter()
        res = evaluate_online(pred, trace, rows, groups, cfg.hot_n, cfg.hot_slack, progress)
        res["cycles"] = pred.online_cycles()
        res["seconds"] = time.perf_counter() - t0
        out[which] = res
    return out


def check_targets(methods: dict[str, Any], online: dict[str, Any], headline: str, distances: list[int]) -> dict:
    """The issue's targets: headline >= gate and stats per group (test), shift drop, MoEless vs gate per distance."""
    out: dict[str, Any] = {}
    test = {name: m["test"]["groups"] for name, m in methods.items() if "test" in m}
    gate1 = next((n for n in methods if methods[n]["kind"] == "gate" and methods[n]["distance"] == 1), None)
    stats = next((n for n in methods if methods[n]["kind"] == "stats"), None)
    if headline in test:
        per_group = {}
        for g, m in test[headline].items():
            row = {headline: m["hit"]}
            for other in (gate1, stats):
                if other is not None and g in test.get(other, {}):
                    row[other] = test[other][g]["hit"]
            row["met"] = all(m["hit"] >= v - 1e-12 for k, v in row.items() if k != headline)
            per_group[g] = row
        out["headline_ge_gate_and_stats_hit"] = per_group
    if headline in methods and "shift" in methods[headline]:
        frozen_test = methods[headline]["test"]["groups"]["all"]["hit"]
        drop = {"frozen": frozen_test - methods[headline]["shift"]["groups"]["all"]["hit"]}
        if "shift" in online and "test" in online:
            drop["online"] = online["test"]["groups"]["all"]["hit"] - online["shift"]["groups"]["all"]["hit"]
            drop["online_gain_on_shift"] = online["shift"]["groups"]["all"]["hit"] - methods[headline]["shift"]["groups"]["all"]["hit"]
        out["headline_shift_drop_hit"] = drop
    by_d = {}
    for d in distances:
        g = next((n for n in methods if methods[n]["kind"] == "gate" and methods[n]["distance"] == d), None)
        m = next((n for n in methods if methods[n]["kind"] == "moeless" and methods[n]["distance"] == d), None)
        if g and m and "test" in methods[g] and "test" in methods[m]:
            ga, ma = methods[g]["test"]["groups"]["all"], methods[m]["test"]["groups"]["all"]
            by_d[str(d)] = {"gate_load_acc": ga["load_acc"], "moeless_load_acc": ma["load_acc"],
                            "gate_hit": ga["hit"], "moeless_hit": ma["hit"],
                            "met": ma["load_acc"] >= ga["load_acc"] - 1e-12,
                            "strictly_above": ma["load_acc"] > ga["load_acc"]}
    if by_d:
        out["moeless_ge_gate_load_acc"] = by_d
    return out


def results_table(methods: dict[str, Any], groups: list[str], model: str) -> Table:
    table = Table(title=f"predictor accuracy (top-k hit rate / hot Top-4 in Top-6): {model}", header_style="bold")
    table.add_column("method")
    for g in groups:
        table.add_column(f"test {g}", justify="right")
    table.add_column("shift all", justify="right")
    table.add_column("MB/layer", justify="right")

    def cell(res: dict, g: str) -> str:
        m = res.get("groups", {}).get(g)
        return "-" if not m else f"{m['hit']:.3f} / {m['hot']:.3f}"

    for name, m in methods.items():
        mem = m.get("memory_mb", {})
        table.add_row(name, *[cell(m.get("test", {}), g) for g in groups], cell(m.get("shift", {}), "all"),
                      f"{max(mem.values()):.3f}" if mem else "-")
    return table


def runnable_methods(cfg: PredictorsTrainConfig, trace: RoutingTrace, where: str
                     ) -> tuple[dict[str, PredictorConfig], dict[str, str]]:
    """The methods the trace can train: all with gate inputs; without them the routing-only ones (and the oracle),
    the rest skipped with the reason. The headline predictor must be trainable."""
    methods, skipped = {}, {}
    for name, pcfg in method_configs(cfg).items():
        if trace.hidden is None and pcfg.kind not in ROUTING_ONLY + (PredictorKind.oracle,):
            skipped[name] = f"{where} has no gate inputs (hidden states); {pcfg.kind.value} reads them"
        else:
            methods[name] = pcfg
    if cfg.predictor.name in skipped:
        raise ValueError(f"predictor={cfg.predictor.name}: {skipped[cfg.predictor.name]}; train predictor=stats or "
                         "predictor=transition on it, or record a trace with gate inputs (python -m engine.record)")
    return methods, skipped


def run(cfg: PredictorsTrainConfig, tm: Telemetry) -> dict[str, Any]:
    model_cfg = resolve_model_config(cfg.model)
    checkpoints = training_checkpoints(cfg, tm.run_dir)
    trace_path = cfg.trace or resumed_trace(checkpoints, "trace.npz")
    where = f"trace={trace_path or 'recorded'}"
    trace = training_trace(trace_path, cfg.workload, cfg, tm, "trace.npz", model_cfg.num_experts)
    todo, skipped = runnable_methods(cfg, trace, where)
    reads_hidden = any(p.kind not in ROUTING_ONLY + (PredictorKind.oracle,) for p in todo.values())
    check_trace(trace, model_cfg, where, need_hidden=reads_hidden)
    shift_path = cfg.shift_trace or resumed_trace(checkpoints, "shift_trace.npz")
    shift_skipped = shift_recording_skipped(cfg, trace_path, shift_path, reads_hidden)
    shift = training_trace(shift_path, cfg.shift_workload, cfg, tm, "shift_trace.npz",
                           model_cfg.num_experts) if cfg.shift and shift_skipped is None else None
    if shift is not None:
        check_trace(shift, model_cfg, f"shift_trace={shift_path or 'recorded'}", need_hidden=reads_hidden)
    split = split_rows(trace, cfg.test_fraction, cfg.val_fraction, cfg.split_seed)
    if trace.hidden is not None:
        groups = layer_groups(cfg.predictor.llapor.groups, trace, split.train)
    else:  # data-driven groups read gate inputs: without them, the configured lists (every layer middle by default)
        groups = groups_from_spec(cfg.predictor.llapor.groups, trace.num_layers)
    kernels: list[np.ndarray] = []
    biases: list[np.ndarray] = []
    embedding = np.zeros((0, 0), np.float32)
    if reads_hidden:  # the gate copies and the token embedding come from the model
        _, model, _ = load_model(cfg.model, seed=cfg.seed, with_experts=False)
        kernels, biases = gate_copies(model)
        embedding = np.asarray(model.embedding(), np.float32)
    data = TrainData(trace=trace, split=split, groups=groups, model_cfg=model_cfg, kernels=kernels, biases=biases,
                     embedding=embedding, progress=tm.progress, checkpoints=checkpoints)
    out_dir = resolve_path(cfg.out) if cfg.out else tm.run_dir / "predictors"
    group_layers = {g: list(v) for g, v in groups.as_dict().items()}
    sets = evaluation_sets(trace, split, shift)
    distances = sorted({int(d) for d in cfg.distances})

    methods: dict[str, Any] = {}
    loads: dict[str, Any] = {}
    headline_folder: Optional[Path] = None
    for name, pcfg in todo.items():
        if pcfg.kind is PredictorKind.oracle:  # reads the routing of whichever trace it is scored on
            entry: dict[str, Any] = {"kind": pcfg.kind.value, "distance": pcfg.distance}
            for which, (tr, rows) in sets.items():
                entry[which] = evaluate_offline(load_predictor(pcfg, trace=tr), tr, rows, group_layers, cfg.hot_n,
                                                cfg.hot_slack)
            methods[name] = entry
            continue
        t0 = time.perf_counter()
        preds, notes = train_method(pcfg, data, distances)
        train_s = time.perf_counter() - t0
        for key, pred in preds.items():
            entry = {"kind": pred.kind, "distance": pred.distance, "memory_mb": pred.memory_mb(),
                     "train_seconds": train_s / len(preds), **notes.get(key, {})}
            for which, (tr, rows) in sets.items():
                keep: dict = {}
                entry[which] = evaluate_offline(pred, tr, rows, group_layers, cfg.hot_n, cfg.hot_slack, keep)
                if which == "test" and pred.distance == 1 and pred.kind in ("gate", "moeless", "llapor"):
                    loads[key] = keep
            # the held-out hit rates travel with the predictor: consumers' hit_rate() before run-time evidence
            pred.prior_hit = {t: m["hit"] for t, m in entry["test"]["layers"].items()}
            folder = save_predictor(pred, out_dir / key.replace("@", "_"))
            entry["checkpoint"] = str(folder)
            if pcfg is cfg.predictor:
                headline_folder = folder
            methods[key] = entry
            for which in sets:
                tm.log({f"{key}/{which}/{g}/{m}": v for g, ms in entry[which]["groups"].items() for m, v in ms.items()})

    online: dict[str, Any] = {}
    if cfg.online and headline_folder is not None and cfg.predictor.kind is PredictorKind.llapor \
            and cfg.predictor.llapor.online.enabled:
        online = headline_online(headline_folder, sets, group_layers, cfg, tm.progress)
    results: dict[str, Any] = {
        "model": {"name": cfg.model.name, "family": model_cfg.family.value, "moe_layers": len(model_cfg.moe_layers),
                  "num_experts": model_cfg.num_experts, "top_k": model_cfg.num_experts_per_tok,
                  "hidden_size": model_cfg.hidden_size},
        "data": {"rows": trace.num_rows, "sequences": int(len(np.unique(trace.seq))),
                 "train_rows": int(split.train.sum()), "val_rows": int(split.val.sum()), "test_rows": int(split.test.sum()),
                 "shift_rows": shift.num_rows if shift is not None else 0, "source": trace.meta.source,
                 "shift_source": shift.meta.source if shift is not None else None},
        "groups": groups.to_json(),
        "headline": cfg.predictor.name,
        "checkpoints": str(out_dir),
        "training_checkpoints": str(checkpoints.folder) if checkpoints is not None else None,
        "resumed_from": str(checkpoints.resume) if checkpoints is not None and checkpoints.resume else None,
        "methods": methods,
        "skipped": skipped,
        "shift_skipped": shift_skipped,
        "online": online,
        "targets": check_targets(methods, online, cfg.predictor.name, distances),
    }
    if cfg.plots:
        results["plots"] = [p.name for p in make_plots(results, loads, list(sets), tm)]
    return results


def make_plots(results: dict[str, Any], loads: dict[str, Any], sets: list[str], tm: Telemetry) -> list[Path]:
    methods, model = results["methods"], results["model"]["name"]
    groups = {g: v for g, v in results["groups"].items() if g in ("input", "middle", "output")}
    at_d1 = {n: m for n, m in methods.items() if m["distance"] == 1}
    paths = [tm.save_figure(accuracy_figure(at_d1, groups, sets, model=model), "accuracy_per_layer.png")]
    by_distance: dict[str, dict[int, dict]] = {}
    for n, m in methods.items():
        base = n.split("@")[0]
        if "test" in m:
            by_distance.setdefault(base, {})[m["distance"]] = m["test"]["groups"]["all"]
    multi = {n: rows for n, rows in by_distance.items() if len(rows) > 1}
    if multi:
        paths.append(tm.save_figure(distance_figure(multi, "test", model), "moeless_distance.png"))
    if loads:
        paths.append(tm.save_figure(load_correlation_figure(loads, model), "load_correlation.png"))
    headline = results["headline"]
    if results["online"] and headline in methods:
        paths.append(tm.save_figure(online_figure(methods[headline], results["online"], sets, model), "online.png"))
    return paths


def headline(results: dict[str, Any]) -> dict[str, Any]:
    """Test hit rates of every method and of online fine-tuning, in one flat table."""
    flat = {"test_rows": results["data"]["test_rows"], "shift_rows": results["data"]["shift_rows"],
            **{f"{n}/test_hit": m["test"]["groups"]["all"]["hit"] for n, m in results["methods"].items()
               if "all" in m["test"]["groups"]}}
    for which, res in results["online"].items():
        flat[f"online/{which}_hit"] = res["groups"]["all"]["hit"]
    return flat


@hydra_task("predictors_train", summarize=headline)
def main(node: DictConfig, tm: Telemetry) -> dict[str, Any]:
    cfg: PredictorsTrainConfig = OmegaConf.to_object(node)  # type: ignore[assignment]
    results = run(cfg, tm)
    console.print(results_table(results["methods"], ["input", "middle", "output", "all"], results["model"]["name"]))
    return results


if __name__ == "__main__":
    main()
