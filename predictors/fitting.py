"""Training loops of the learned predictors: optax AdamW with epoch-based schedules, one jitted scan per epoch.

A `loss_fn(params, consts, batch, key) -> scalar` closes over what is static (loss kind and
weights); `consts` are per-layer arrays that are not trained (PCA, expert frequencies) and `batch`
a tuple of arrays whose first axis indexes tokens. Compiled epochs and steps are cached by a
caller-given key, so layers of the same shape share one compilation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import dataclasses
from typing import Any, Callable, Hashable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from conf.schemas.predictor import OptimSpec, Schedule

LossFn = Callable[[Any, Any, tuple, Optional[jax.Array]], jax.Array]
_COMPILED: dict[Hashable, Callable] = {}


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


def make_optimizer(spec: OptimSpec, steps_per_epoch: int, epochs: int) -> optax.GradientTransformation:
    """AdamW (per-group learning rate and weight decay) after global-norm clipping."""
    return optax.chain(optax.clip_by_global_norm(spec.clip_norm),
                       optax.adamw(lr_schedule(spec, steps_per_epoch, epochs), weight_decay=spec.weight_decay))


@dataclass
class FitResult:
    params: Any
    epoch_loss: list[float] = field(default_factory=list)  # mean training loss per epoch
    steps: int = 0


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


def fit(params: Any, loss_fn: LossFn, consts: Any, arrays: Sequence[np.ndarray], spec: OptimSpec, epochs: int,
        batch_size: int, seed: int = 0, on_epoch: Optional[Callable[[int, float, Any], bool]] = None,
        cache_key: Optional[Hashable] = None) -> FitResult:
    """Train `params` for `epochs` epochs; `on_epoch(epoch, loss, params)` returning True stops early.

    `cache_key` names `loss_fn` (same key: same function); the compiled epoch is reused across calls.
    """
    arrays = tuple(jnp.asarray(a) for a in arrays)
    n_batches, size = batches_per_epoch(int(arrays[0].shape[0]), batch_size)
    tx = make_optimizer(spec, n_batches, epochs)
    opt_state = tx.init(params)
    key_ = None if cache_key is None else ("epoch", cache_key, dataclasses.astuple(spec), epochs, n_batches, size)
    run = _cached(key_, lambda: make_epoch(loss_fn, tx, n_batches, size))
    key = jax.random.PRNGKey(seed)
    result = FitResult(params=params)
    for e in range(epochs):
        params, opt_state, loss = run(params, opt_state, consts, arrays, jax.random.fold_in(key, e))
        result.epoch_loss.append(float(loss))
        result.steps += n_batches
        result.params = params
        if on_epoch is not None and on_epoch(e, float(loss), params):
            break
    return result


def make_step(loss_fn: LossFn, tx: optax.GradientTransformation, cache_key: Optional[Hashable] = None) -> Callable:
    """One jitted update (params, opt_state, consts, batch, key) -> (params, opt_state, loss) (online fine-tuning)."""

    def build() -> Callable:
        def step(params: Any, opt_state: Any, consts: Any, batch: tuple, key: jax.Array) -> tuple:
            loss, grads = jax.value_and_grad(loss_fn)(params, consts, batch, key)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        return jax.jit(step)

    return _cached(None if cache_key is None else ("step", cache_key), build)
