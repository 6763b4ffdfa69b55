"""Training loops of the learned predictors: optax AdamW with epoch-based schedules, one jitted scan per epoch.

A `loss_fn(params, consts, batch, key) -> scalar` closes over what is static (loss kind and
weights); `consts` are per-layer arrays that are not trained (PCA, expert frequencies) and `batch`
a tuple of arrays whose first axis indexes tokens. Compiled epochs and steps are cached by a
caller-given key, so layers of the same shape share one compilation.

With `Checkpoints`, a fit saves (params, optimiser state, epoch losses, the caller's `state`) with orbax every
`every` epochs and at its end, and first continues from the newest intact step of an interrupted run. The
epoch is the unit: one epoch is one compiled scan, and its shuffle and dropout keys are a pure function of
(seed, epoch), so a resumed fit replays exactly the updates the interrupted one would have made.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Hashable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from predictors.config import OptimSpec, Schedule
from models.checkpointing import checkpoint_manager, restore_latest, saved_steps
from models.training import make_optimizer

LossFn = Callable[[Any, Any, tuple, Optional[jax.Array]], jax.Array]
_COMPILED: dict[Hashable, Callable] = {}
log = logging.getLogger(__name__)


def lr_schedule(spec: OptimSpec, steps_per_epoch: int, epochs: int) -> optax.Schedule:
    """Linear warmup over `warmup_epochs`, then cosine decay to `min_lr_ratio * lr` (or constant)."""
    if spec.schedule is Schedule.constant:
        return optax.constant_schedule(spec.lr)
    warmup = max(0, spec.warmup_epochs) * steps_per_epoch
    total = max(epochs * steps_per_epoch, warmup + 1)
    cosine = optax.cosine_decay_schedule(spec.lr, total - warmup, alpha=spec.min_lr_ratio)
    if warmup == 0:
        return cosine
    return optax.join_schedules([optax.linear_schedule(spec.lr / warmup, spec.lr, warmup), cosine], [warmup])


@dataclass
class FitResult:
    params: Any
    epoch_loss: list[float] = field(default_factory=list)  # mean training loss per epoch
    steps: int = 0


@dataclass(frozen=True)
class Checkpoints:
    """Where fits save their state and where interrupted fits resume from (`scoped` per method and layer)."""

    folder: Path  # this run's checkpoints: <folder>/<epochs done>/
    every: int  # epochs between saves (the last epoch is always saved); 0: save nothing
    keep: int = 2  # newest steps kept per folder
    resume: Optional[Path] = None  # the same layout of an interrupted run (may be `folder` itself)


def scoped(checkpoints: Optional[Checkpoints], name: str) -> Optional[Checkpoints]:
    """`checkpoints` one folder down (a method, a target layer) on both the saving and the resuming side."""
    if checkpoints is None:
        return None
    return replace(checkpoints, folder=checkpoints.folder / name,
                   resume=None if checkpoints.resume is None else checkpoints.resume / name)


def batches_per_epoch(num_rows: int, batch_size: int) -> tuple[int, int]:
    """(batches, batch size): full batches only; a dataset smaller than a batch is one batch."""
    if num_rows < 1:
        raise ValueError("predictor training: no training rows")
    size = min(batch_size, num_rows)
    return num_rows // size, size


def _cached(key: Optional[Hashable], build: Callable[[], Callable]) -> Callable:
    if key is None:
        return build()
    if key not in _COMPILED:
        _COMPILED[key] = build()
    return _COMPILED[key]


def make_epoch(loss_fn: LossFn, tx: optax.GradientTransformation, n_batches: int, batch_size: int) -> Callable:
    """A jitted epoch (params, opt_state, consts, arrays, key) -> (params, opt_state, mean loss), shuffled order."""

    def epoch(params: Any, opt_state: Any, consts: Any, arrays: tuple, key: jax.Array) -> tuple:
        perm_key, drop_key = jax.random.split(key)
        n = arrays[0].shape[0]
        order = jax.random.permutation(perm_key, n)[: n_batches * batch_size].reshape(n_batches, batch_size)

        def body(carry: tuple, xs: tuple) -> tuple:
            params, opt_state = carry
            idx, i = xs
            batch = tuple(a[idx] for a in arrays)
            loss, grads = jax.value_and_grad(loss_fn)(params, consts, batch, jax.random.fold_in(drop_key, i))
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        (params, opt_state), losses = jax.lax.scan(body, (params, opt_state), (order, jnp.arange(n_batches)))
        return params, opt_state, jnp.mean(losses)

    return jax.jit(epoch)


def _snapshot(params: Any, opt_state: Any, losses: np.ndarray, finished: bool, state: Optional[dict]) -> dict:
    """What a checkpoint holds; `losses` float32 [epochs] (NaN past the epochs done), copied: saves are async."""
    tree = {"params": params, "opt_state": opt_state, "losses": losses.copy(),
            "finished": np.asarray(finished, np.int32)}
    if state:
        tree["state"] = dict(state)
    return tree


def _resume(checkpoints: Optional[Checkpoints], fresh: dict, epochs: int) -> tuple[int, dict]:
    """(epochs done, snapshot) of the newest intact step of `checkpoints.resume`; (0, `fresh`) without one."""
    if checkpoints is None or checkpoints.resume is None or not saved_steps(checkpoints.resume):
        return 0, fresh  # this layer was not reached before the interruption
    step, snap = restore_latest(checkpoints.resume, fresh)
    log.info("resume: %s at epoch %d of %d", checkpoints.resume, step, epochs)
    return step, snap


def _saver(checkpoints: Optional[Checkpoints], start: int, restored: dict) -> Optional[ocp.CheckpointManager]:
    """The manager of this fit's own folder, holding the resumed step and no newer one; None: no saves."""
    if checkpoints is None or checkpoints.every < 1:
        return None
    mngr = checkpoint_manager(checkpoints.folder, checkpoints.keep)
    for step in mngr.all_steps():
        # past where this fit starts (a damaged step an in-place resume skipped, or an older run's in a reused
        # folder): orbax refuses to save over an existing step
        if step > start:
            mngr.delete(step)
    if start and start not in mngr.all_steps():  # resumed from another run: this run is resumable from here too
        mngr.save(start, args=ocp.args.StandardSave(restored))
    return mngr


def fit(params: Any, loss_fn: LossFn, consts: Any, arrays: Sequence[np.ndarray], spec: OptimSpec, epochs: int,
        batch_size: int, seed: int = 0, on_epoch: Optional[Callable[[int, float, Any], bool]] = None,
        cache_key: Optional[Hashable] = None, checkpoints: Optional[Checkpoints] = None,
        state: Optional[dict[str, Any]] = None) -> FitResult:
    """Train `params` for `epochs` epochs; `on_epoch(epoch, loss, params)` returning True stops early.

    `cache_key` names `loss_fn` (same key: same function); the compiled epoch is reused across calls.
    `checkpoints`: save every `checkpoints.every` epochs and at the end (a full or early stop); first continue
    from `checkpoints.resume` (a finished fit is not trained again). `state`: numpy arrays `on_epoch` carries
    across epochs (MoEless's best kernel so far), saved with each checkpoint and restored into the dict in place.
    """
    arrays = tuple(jnp.asarray(a) for a in arrays)
    n_batches, size = batches_per_epoch(int(arrays[0].shape[0]), batch_size)
    tx = make_optimizer(lr_schedule(spec, n_batches, epochs), spec.weight_decay, spec.clip_norm)
    fresh = _snapshot(params, tx.init(params), np.full(epochs, np.nan, np.float32), False, state)
    done, snap = _resume(checkpoints, fresh, epochs)
    params, opt_state, finished = snap["params"], snap["opt_state"], bool(snap["finished"])
    losses = np.array(snap["losses"], np.float32)  # a writable copy
    if state is not None and "state" in snap:
        state.update(snap["state"])
    key_ = None if cache_key is None else ("epoch", cache_key, dataclasses.astuple(spec), epochs, n_batches, size)
    run = _cached(key_, lambda: make_epoch(loss_fn, tx, n_batches, size))
    key = jax.random.PRNGKey(seed)
    mngr = _saver(checkpoints, done, snap)
    every = checkpoints.every if checkpoints is not None else 0
    try:
        while done < epochs and not finished:
            params, opt_state, loss = run(params, opt_state, consts, arrays, jax.random.fold_in(key, done))
            losses[done] = loss
            done += 1
            stop = on_epoch is not None and bool(on_epoch(done - 1, float(losses[done - 1]), params))
            finished = stop or done == epochs
            if mngr is not None and (finished or done % every == 0):
                mngr.save(done, args=ocp.args.StandardSave(_snapshot(params, opt_state, losses, finished, state)))
    finally:
        if mngr is not None:
            mngr.close()  # waits for the save in flight: even an interrupted fit leaves its last checkpoint whole
    return FitResult(params=params, epoch_loss=[float(v) for v in losses[:done]], steps=n_batches * done)


def make_step(loss_fn: LossFn, tx: optax.GradientTransformation, cache_key: Optional[Hashable] = None) -> Callable:
    """One jitted update (params, opt_state, consts, batch, key) -> (params, opt_state, loss) (online fine-tuning)."""

    def build() -> Callable:
        def step(params: Any, opt_state: Any, consts: Any, batch: tuple, key: jax.Array) -> tuple:
            loss, grads = jax.value_and_grad(loss_fn)(params, consts, batch, key)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        return jax.jit(step)

    return _cached(None if cache_key is None else ("step", cache_key), build)
