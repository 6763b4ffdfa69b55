"""Trained predictors on disk: one folder per predictor, arrays saved with orbax.

    <folder>/predictor.json   schema `moescope.predictor` v1: kind, name, distance, shapes, the
                              predictor config, the model config (gate copies), layer groups
                              (LLaPor), profile (MoEless), footprint
    <folder>/arrays/          orbax checkpoint of {"layers": {"<target layer>": pytree}, "shared": pytree}

A folder is written next to its final place and renamed into it, so a crash never leaves half a
predictor behind; loading checks the schema, the kind and the layers, naming the file.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

import jax
import numpy as np

from core.config import to_frozen
from predictors.config import LayerGroup, PredictorConfig
from core.telemetry import atomic_write_text, to_jsonable
from models.config import ModelConfig
from predictors.common import TrainedPredictor
from predictors.config import config_dict, predictor_config
from predictors.gate import GatePredictor
from predictors.groups import LayerGroups
from predictors.llapor import LayerNet, LLaPorPredictor
from predictors.moeless import MoElessPredictor
from predictors.stats import StatsPredictor
from predictors.token import TokenPredictor
from predictors.transition import TransitionPredictor

SCHEMA = "moescope.predictor"
VERSION = 1
META_FILE = "predictor.json"


class PredictorCheckpointError(ValueError):
    """A predictor folder that is missing, of another kind, or inconsistent (message names the file)."""


def _checkpointer() -> Any:
    import orbax.checkpoint as ocp  # orbax: only saving / loading arrays needs it, not reading predictor.json

    return ocp.StandardCheckpointer()


def predictor_meta(pred: TrainedPredictor) -> dict[str, Any]:
    meta: dict[str, Any] = {"schema": SCHEMA, "version": VERSION, "kind": pred.kind, "name": pred.name,
                            "distance": pred.distance, "num_layers": pred.num_layers, "num_experts": pred.num_experts,
                            "top_k": pred.top_k, "targets": pred.targets,
                            "memory_mb": {str(t): mb for t, mb in pred.memory_mb().items()},
                            "measured_hit": {str(t): h for t, h in pred.prior_hit.items()}}
    cfg = getattr(pred, "cfg", None)
    if isinstance(cfg, PredictorConfig):
        meta["config"] = config_dict(cfg)
    if isinstance(pred, StatsPredictor):
        meta["online"] = pred.online
    if isinstance(pred, GatePredictor):
        meta["model_config"] = to_jsonable(dataclasses.asdict(pred.model_cfg))
    if isinstance(pred, MoElessPredictor):
        meta["profile"] = {str(t): r for t, r in pred.profile.items()}
    if isinstance(pred, LLaPorPredictor):
        meta["groups"] = pred.groups.to_json()
        meta["layer_groups"] = {str(t): pred.layers[t].group.value for t in pred.targets}
    return to_jsonable(meta)


def save_predictor(pred: TrainedPredictor, folder: str | Path, extra: Optional[dict[str, Any]] = None) -> Path:
    """Write `pred` into `folder` (replacing a previous predictor there)."""
    folder = Path(folder).absolute()
    folder.parent.mkdir(parents=True, exist_ok=True)
    tree: dict[str, Any] = {"layers": {str(t): a for t, a in pred.layer_arrays().items()}}
    shared = pred.shared_arrays()
    if shared is not None:
        tree["shared"] = shared
    tree = jax.tree_util.tree_map(np.asarray, tree)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    try:
        ckpt = _checkpointer()
        ckpt.save(tmp / "arrays", tree)
        ckpt.wait_until_finished()
        atomic_write_text(tmp / META_FILE, json.dumps({**predictor_meta(pred), **to_jsonable(extra or {})}, indent=2))
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def read_meta(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / META_FILE
    if not path.is_file():
        raise PredictorCheckpointError(f"{path}: no such file (not a predictor folder written by predictors.train)")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise PredictorCheckpointError(f"{path}: not JSON: {exc}") from None
    if meta.get("schema") != SCHEMA or meta.get("version") != VERSION:
        raise PredictorCheckpointError(f"{path}: schema {meta.get('schema')!r} v{meta.get('version')!r}, "
                                       f"expected {SCHEMA!r} v{VERSION}")
    return meta


def load_arrays(folder: str | Path) -> dict[str, Any]:
    path = Path(folder).absolute() / "arrays"
    if not path.is_dir():
        raise PredictorCheckpointError(f"{path}: no orbax checkpoint")
    return _checkpointer().restore(path)


def _layer(tree: dict[str, Any], target: int, where: Path) -> Any:
    try:
        return tree["layers"][str(target)]
    except KeyError:
        raise PredictorCheckpointError(f"{where}: no arrays for target layer {target}") from None


def load_predictor_folder(folder: str | Path) -> TrainedPredictor:
    """The trained predictor saved in `folder` (any kind but oracle), with its offline hit rates."""
    pred = _build(Path(folder))
    pred.prior_hit = {int(t): float(h) for t, h in read_meta(folder).get("measured_hit", {}).items()}
    return pred


def _build(folder: Path) -> TrainedPredictor:
    meta = read_meta(folder)
    tree = load_arrays(folder)
    kind, name, d = meta["kind"], meta["name"], int(meta["distance"])
    L, E, k = int(meta["num_layers"]), int(meta["num_experts"]), int(meta["top_k"])
    targets = list(range(d, L))
    arrays = {t: _layer(tree, t, folder) for t in targets}
    if kind == "stats":
        counts = np.zeros((L, E), np.float64)
        for t in targets:
            counts[t] = arrays[t]["counts"]
        return StatsPredictor(name, d, counts, k, online=bool(meta.get("online", False)))
    if kind == "transition":
        counts, freq = np.zeros((L, E, E), np.int64), np.zeros((L, E), np.int64)
        for t in targets:
            counts[t], freq[t] = np.rint(arrays[t]["counts"]), np.rint(arrays[t]["target_freq"])
        return TransitionPredictor(name, d, counts, freq, k)
    if kind in ("gate", "moeless"):
        model_cfg = to_frozen(meta["model_config"], ModelConfig)
        kernels = {t: np.asarray(a["kernel"]) for t, a in arrays.items()}
        biases = {t: np.asarray(a["bias"]) for t, a in arrays.items()}
        if kind == "gate":
            return GatePredictor(name, d, model_cfg, kernels, biases)
        profile = {int(t): r for t, r in meta.get("profile", {}).items()}
        return MoElessPredictor(name, d, model_cfg, kernels, biases, profile)
    cfg = predictor_config(meta["config"])
    if kind == "token":
        return TokenPredictor(name, cfg, L, E, k, tree["shared"]["table"], arrays)
    if kind == "llapor":
        groups = LayerGroups.from_json(meta["groups"])
        layers = {t: LayerNet(group=LayerGroup(meta["layer_groups"][str(t)]), net=a["net"], mean=a["mean"],
                              comps=a["comps"], inv_freq=a["inv_freq"]) for t, a in arrays.items()}
        return LLaPorPredictor(name, cfg, L, E, k, groups, layers)
    raise PredictorCheckpointError(f"{folder / META_FILE}: unknown predictor kind {kind!r}")
