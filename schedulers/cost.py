"""Cost model of offloaded MoE inference (LayerScope §4.3.2) and the device-memory budget.

Built from a `ModelConfig` and a `HardwareProfile`; every time is in seconds.

- `t_io`: one expert host -> device, `latency + bytes / (peak * efficiency)` (pinned, asynchronous,
  chunked: AsyncIO) or a measured value; `t_io_sync` the synchronous pageable copy (no AsyncIO).
- `t_g(m)`: one expert on the GPU for m tokens in a call of its own (an on-demand load), a roofline
  over the expert GEMMs plus the per-expert kernel cost plus the per-call dispatch cost;
  `t_g_group(ms)` the same experts run in one call (the resident experts of a layer): one dispatch.
- `layer_overhead_s` / `pass_overhead_s`: the executor's fixed host time per MoE layer (router
  output to the host, planning, issuing the plan) and per forward pass (embedding, masks, logits to
  the host). 0 for the paper's GPU profiles; measured by `engine.calibrate` on this machine.
- `t_c(m) = beta * m + C` (eq. 2): one expert on the CPU; beta from the CPU's achieved GEMM rate,
  C = dispatch overhead + streaming the expert's weights from DRAM once. `t_c_sum` (a layer's CPU
  experts) adds `cpu_dispatch_s` once: handing the layer's CPU side to the worker and merging back.
- `t_attn(batch, ctx, phase)`: a decoder layer's attention block (projections + attention over the
  KV cache + gate) on the GPU; prefill and decode variants differ in tokens and KV traffic.
- `update_*`: the executor's Timer feeds measured times; eq. 2 is refitted by running least squares,
  the GPU call's dispatch follows a sliding median that counts the profile's value as several samples
  (its samples are few and noisy), the other fixed costs an exponential moving average.
"""

from __future__ import annotations

import collections
import math
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import numpy as np

from models.config import ModelConfig

_SCALARS = (int, float, np.integer, np.floating)  # cheaper to test than np.ndim on the per-expert calls
_PREFIX_NUMPY = 24  # `t_c_prefix` of longer lists in numpy (a layer of many small experts); shorter ones in a loop

if TYPE_CHECKING:
    from schedulers.hardware import HardwareProfile

ArrayLike = Union[int, float, np.ndarray]


# ---- parameter counts ------------------------------------------------------------------------
def attention_params(cfg: ModelConfig) -> int:
    """Parameters of one decoder layer's attention block (projections, no norms)."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    if cfg.uses_mla:
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        q = h * heads * qk if cfg.q_lora_rank is None else h * cfg.q_lora_rank + cfg.q_lora_rank * heads * qk
        kv_a = h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        kv_b = cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        return q + kv_a + kv_b + heads * cfg.v_head_dim * h
    hd = cfg.attn_head_dim
    return h * heads * hd + 2 * h * cfg.num_key_value_heads * hd + heads * hd * h


def kv_bytes_per_token(cfg: ModelConfig, bytes_per_param: int = 2) -> int:
    """KV-cache bytes per token per decoder layer (MLA caches the compressed latent + rope key)."""
    if cfg.uses_mla:
        return (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * bytes_per_param
    return 2 * cfg.num_key_value_heads * cfg.attn_head_dim * bytes_per_param


def shared_expert_params(cfg: ModelConfig) -> int:
    """Parameters of the always-on shared expert(s) of one MoE layer (0 where the family has none)."""
    if cfg.shared_expert_intermediate_size:
        return 3 * cfg.hidden_size * cfg.shared_expert_intermediate_size
    return cfg.n_shared_experts * cfg.expert_params


def non_expert_params(cfg: ModelConfig) -> int:
    """Everything but the routed experts: embeddings, head, attention, dense MLPs, shared experts, gates."""
    n_moe = len(cfg.moe_layers)
    n_dense = cfg.num_hidden_layers - n_moe
    embed = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    layers = cfg.num_hidden_layers * attention_params(cfg)
    dense = n_dense * 3 * cfg.hidden_size * cfg.intermediate_size
    moe = n_moe * (shared_expert_params(cfg) + cfg.num_experts * cfg.hidden_size)
    return embed + layers + dense + moe


# ---- memory ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryPlan:
    """Where the device memory goes for one batch shape (bytes); `cache_slots` experts fit the rest."""

    budget_bytes: float
    non_expert_bytes: float
    kv_cache_bytes: float
    activation_bytes: float
    staging_bytes: float
    expert_bytes: int
    cache_slots: int

    @property
    def expert_cache_bytes(self) -> float:
        return self.cache_slots * self.expert_bytes


def memory_plan(cfg: ModelConfig, hw: "HardwareProfile", batch: int, prompt_len: int, gen_len: int,
                staging_slots: int = 2, bytes_per_param: int = 2, expert_format: str = "bf16") -> MemoryPlan:
    """Expert-cache capacity left on one device after weights, KV cache, activations and staging; the cache and the
    staging slots hold experts in `expert_format` (schedulers/formats.py; the rest stays `bytes_per_param`)."""
    from schedulers.formats import expert_format_bytes

    budget = hw.gpu.budget_bytes
    non_expert = non_expert_params(cfg) * bytes_per_param
    kv = batch * (prompt_len + gen_len) * cfg.num_hidden_layers * kv_bytes_per_token(cfg, bytes_per_param)
    prefill_tokens = batch * prompt_len
    per_expert_tokens = math.ceil(prefill_tokens * cfg.num_experts_per_tok / cfg.num_experts)
    # live hidden states (residual, normed, expert output, attention output) + one expert's intermediates
    activation = (4 * prefill_tokens * cfg.hidden_size + 3 * per_expert_tokens * cfg.expert_intermediate_size) * bytes_per_param
    e_bytes = math.ceil(expert_format_bytes(cfg, expert_format, bytes_per_param))
    staging = staging_slots * e_bytes
    free = budget - non_expert - kv - activation - staging
    slots = int(free // e_bytes)
    if slots < 0:
        raise ValueError(
            f"memory: {hw.name} ({budget / 2**30:.1f} GiB usable) cannot hold {cfg.family.value} at batch {batch}: "
            f"non-expert {non_expert / 2**30:.2f} GiB + KV {kv / 2**30:.2f} GiB + activations {activation / 2**30:.2f} GiB "
            f"+ staging {staging / 2**30:.2f} GiB")
    total = cfg.num_experts * len(cfg.moe_layers)
    return MemoryPlan(budget, non_expert, kv, activation, staging, e_bytes, min(slots, total))


# ---- times -----------------------------------------------------------------------------------
# Single-expert GPU samples come only from on-demand loads: few, and on a shared host some are several
# times the typical call. The dispatch estimate is the median of the last GPU_WINDOW samples with the
# profile's value standing for GPU_PRIOR_SAMPLES of them, so a stray pair cannot move it (an average
# would: two stray samples tens of times the typical call multiplied it, and every expert went to the CPU).
GPU_PRIOR_SAMPLES = 8
GPU_WINDOW = 40


class _RunningFit:
    """Least squares y = a * x + b over a window of observations (the Timer's eq. 2 refit).

    Only fitted once the observed x span at least `min_span`: decode passes see experts of 1-8
    tokens, where timing noise decides the slope (it came out 0 on this machine, making the CPU look
    free for a prefill's hundreds of tokens). Every CPU expert of a run is a sample, so the fit keeps
    running sums (O(1) per sample; `np.polyfit` over the window at every sample, several per layer, cost too much),
    recomputed from the window every `window` samples so rounding cannot build up."""

    def __init__(self, window: int = 256, min_span: float = 16.0):
        self.window = window
        self.min_span = min_span
        self.xs: collections.deque[float] = collections.deque()
        self.ys: collections.deque[float] = collections.deque()
        self._sums = [0.0, 0.0, 0.0, 0.0]  # sum x, sum y, sum x^2, sum x*y over the window
        self._since_exact = 0

    def _accumulate(self, x: float, y: float, sign: float) -> None:
        s = self._sums
        s[0] += sign * x
        s[1] += sign * y
        s[2] += sign * x * x
        s[3] += sign * x * y

    def add(self, x: float, y: float) -> Optional[tuple[float, float]]:
        x, y = float(x), float(y)
        self.xs.append(x)
        self.ys.append(y)
        self._accumulate(x, y, 1.0)
        if len(self.xs) > self.window:
            self._accumulate(self.xs.popleft(), self.ys.popleft(), -1.0)
        self._since_exact += 1
        if self._since_exact >= self.window:
            self._sums = [0.0, 0.0, 0.0, 0.0]
            for xi, yi in zip(self.xs, self.ys):
                self._accumulate(xi, yi, 1.0)
            self._since_exact = 0
        n = len(self.xs)
        if n < 2 or max(self.xs) - min(self.xs) < self.min_span:
            return None
        sx, sy, sxx, sxy = self._sums
        a = (n * sxy - sx * sy) / (n * sxx - sx * sx)
        b = (sy - a * sx) / n
        return max(a, 0.0), max(b, 0.0)


class CostModel:
    """Per-operation times of one model on one machine (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, hw: "HardwareProfile", model_name: str = "", bytes_per_param: int = 2,
                 ema: float = 0.2, expert_bytes: Optional[int] = None, expert_format: str = "bf16",
                 expert_blocks: Optional[Sequence[Any]] = None):
        """`expert_format`: the routed experts' `model.expert_format` (schedulers/formats.py): their bytes (transfers,
        GPU streaming, the CPU's read) and the measured CPU / GPU rates of their block types against bf16.
        `expert_blocks`: each MoE layer's block types as the store holds them (a GGUF file's, a saved folder's), which
        the costs then follow (`expert_format` is their name, `schedulers.formats.blocks_format`).
        `expert_bytes`: one routed expert's bytes where they are known exactly (`ExpertStore.expert_bytes`, from the
        blocks a checkpoint holds); they replace the format's mean over the layers.
        A profile's `measured` times taken on experts of another format are converted: the transfer by the bytes,
        eq. 2 through bf16 by the two formats' block rates (`_measured_cpu`)."""
        from schedulers.formats import format_costs

        self.cfg, self.hw = cfg, hw
        self.bytes_per_param = bytes_per_param
        self.ema = ema
        self.format = format_costs(cfg, hw, expert_format, bytes_per_param, expert_blocks)
        self.expert_format = expert_format
        self.expert_bytes = expert_bytes or self.format.expert_bytes
        self.expert_flops = 2 * cfg.expert_params  # per token
        measured = hw.measured.get(model_name) if model_name else None
        gpu, cpu, link = hw.gpu, hw.cpu, hw.host_link
        self._gpu_flops = gpu.bf16_tflops * 1e12 * gpu.matmul_efficiency
        self._expert_gpu_flops = self._gpu_flops / self.format.gpu_compute_scale  # dequantized inside the GEMM
        self._gpu_bw = gpu.hbm_gbps * 1e9 * gpu.hbm_efficiency
        self.gpu_overhead_s = gpu.kernel_overhead_us * 1e-6
        self.call_overhead_s = gpu.call_overhead_us * 1e-6
        self.layer_overhead_s = gpu.layer_overhead_us * 1e-6
        self.pass_overhead_s = gpu.pass_overhead_us * 1e-6
        self.cpu_dispatch_s = cpu.dispatch_us * 1e-6
        self.t_io = link.transfer_s(self.expert_bytes)
        self.link_cpu_share = link.host_cpu_share  # host core time a transfer takes, per second of transfer
        self.device_cpu_share = gpu.host_cpu_share  # host core time device compute takes, per second of it
        self.beta_s = self.expert_flops / (cpu.peak_gflops * 1e9 * cpu.matmul_efficiency)
        read_bytes = self.expert_bytes if self.format.name == "bf16" else self.format.bf16_bytes  # scaled below
        self.cpu_startup_s = cpu.expert_overhead_us * 1e-6 + read_bytes / (cpu.memory_gbps * 1e9 * cpu.memory_efficiency)
        if measured is not None:
            if measured.transfer_ms is not None:  # measured on experts of `expert_mib`: the same link for these bytes
                measured_bytes = (measured.expert_mib * 2**20 if measured.expert_mib is not None
                                  else self.format.bf16_bytes if (measured.expert_format or "bf16") == "bf16"
                                  else self.expert_bytes)
                self.t_io = measured.transfer_ms * 1e-3 * self.expert_bytes / measured_bytes
            self.beta_s, self.cpu_startup_s = self._measured_cpu(measured, cpu.expert_overhead_us * 1e-6)
            for attr, ms in (("call_overhead_s", measured.call_overhead_ms), ("layer_overhead_s", measured.layer_overhead_ms),
                             ("pass_overhead_s", measured.pass_overhead_ms), ("cpu_dispatch_s", measured.cpu_dispatch_ms)):
                if ms is not None:
                    setattr(self, attr, ms * 1e-3)
            if measured.gpu_ms is not None:  # one expert in its own call: the call's dispatch is part of it
                self.gpu_overhead_s = max(measured.gpu_ms * 1e-3 - self._gpu_roofline(1) - self.call_overhead_s, 0.0)
        self._scale_cpu(cpu.expert_overhead_us * 1e-6)
        self._cpu_fit = _RunningFit()
        self._gpu_samples: Optional[collections.deque[float]] = None
        self._attn_params = attention_params(cfg)
        self._kv_bytes = kv_bytes_per_token(cfg, bytes_per_param)
        self._shared_params = shared_expert_params(cfg)

    def _measured_cpu(self, measured: Any, overhead_s: float) -> tuple[float, float]:
        """(beta, C) of eq. 2 from a profile's measured times, as bf16 experts' (what `_scale_cpu` scales): times taken
        on quantized experts are divided by their format's rates (by none when it is this model's format, so they
        come back as measured). Times of another format the rates cannot name are dropped for the modelled ones."""
        from schedulers.formats import format_costs

        beta = measured.cpu_beta_ms * 1e-3 if measured.cpu_beta_ms is not None else None
        startup = measured.cpu_startup_ms * 1e-3 if measured.cpu_startup_ms is not None else None
        name = measured.expert_format or "bf16"
        if name != "bf16" and (beta is not None or startup is not None):
            try:
                fmt = self.format if name == self.format.name else format_costs(self.cfg, self.hw, name,
                                                                               self.bytes_per_param)
            except ValueError:  # a block mix only its own model's costs know
                return self.beta_s, self.cpu_startup_s
            beta = None if beta is None else beta / fmt.cpu_beta_scale
            startup = None if startup is None else overhead_s + max(startup - overhead_s, 0.0) / fmt.cpu_read_scale
        return (self.beta_s if beta is None else beta), (self.cpu_startup_s if startup is None else startup)

    def _scale_cpu(self, overhead_s: float) -> None:
        """eq. 2 of bf16 experts (modelled or measured) to the format's: the slope by the kernel's compute rate, the
        intercept's weight streaming (all of it but the call overhead) by the kernel's read time at m = 1."""
        fmt = self.format
        self.beta_s *= fmt.cpu_beta_scale
        self.cpu_startup_s = overhead_s + max(self.cpu_startup_s - overhead_s, 0.0) * fmt.cpu_read_scale

    # eq. 2 and friends --------------------------------------------------------------------------
    @property
    def t_io_sync(self) -> float:
        """One expert through PyTorch's synchronous pageable copy (LayerScope ablation "no AsyncIO")."""
        return self.t_io * self.hw.host_link.sync_copy_slowdown

    def t_c(self, m: ArrayLike) -> ArrayLike:
        """CPU time of one expert for m tokens (eq. 2); 0 where m == 0. Vectorised over arrays."""
        if isinstance(m, _SCALARS):
            return self.beta_s * float(m) + self.cpu_startup_s if m > 0 else 0.0
        m_arr = np.asarray(m, dtype=np.float64)
        out = np.where(m_arr > 0, self.beta_s * m_arr + self.cpu_startup_s, 0.0)
        return float(out) if out.ndim == 0 else out

    # A layer has a handful of experts and the schedulers call these on its critical path: plain
    # Python loops beat numpy's per-call overhead here (sums run in order, as np.cumsum's).
    def t_c_sum(self, ms: Sequence[float]) -> float:
        """CPU time of a layer's CPU experts run one after another (one hand-over to the worker)."""
        total, n = 0.0, 0
        for m in ms:
            if m > 0:
                total += float(m)
                n += 1
        return self.beta_s * total + self.cpu_startup_s * n + self.cpu_dispatch_s if n else 0.0

    def t_c_prefix(self, ms: Sequence[float]) -> list[float]:
        """`t_c_sum(ms[:k+1])` for every k (the CPU side holding the first k+1 experts)."""
        if len(ms) > _PREFIX_NUMPY:  # the same sums in the same order (np.cumsum adds left to right, like the loop)
            m = np.asarray(ms, dtype=np.float64)
            live = m > 0
            acc = np.cumsum(np.where(live, self.beta_s * m + self.cpu_startup_s, 0.0))
            return np.where(np.logical_or.accumulate(live), acc + self.cpu_dispatch_s, acc).tolist()
        out: list[float] = []
        acc, seen = 0.0, False
        beta, startup, dispatch = self.beta_s, self.cpu_startup_s, self.cpu_dispatch_s  # locals: read per element
        for m in ms:
            if m > 0:
                acc += beta * float(m) + startup
                seen = True
            out.append(acc + dispatch if seen else acc)
        return out

    def _gpu_roofline(self, m: ArrayLike) -> ArrayLike:
        m_arr = np.asarray(m, dtype=np.float64)
        return np.maximum(m_arr * self.expert_flops / self._expert_gpu_flops, self.expert_bytes / self._gpu_bw)

    def t_g(self, m: ArrayLike) -> ArrayLike:
        """GPU time of one resident expert for m tokens in a call of its own; 0 where m == 0. Vectorised."""
        fixed = self.gpu_overhead_s + self.call_overhead_s
        if isinstance(m, _SCALARS):
            if m <= 0:
                return 0.0
            return fixed + max(float(m) * self.expert_flops / self._expert_gpu_flops, self.expert_bytes / self._gpu_bw)
        m_arr = np.asarray(m, dtype=np.float64)
        out = np.where(m_arr > 0, fixed + self._gpu_roofline(m_arr), 0.0)
        return float(out) if out.ndim == 0 else out

    def t_g_shares(self, m: ArrayLike) -> np.ndarray:
        """float [n]: each expert's own GPU work in a call with others (the call's dispatch apart); 0 where m == 0."""
        m_arr = np.atleast_1d(np.asarray(m, dtype=np.float64))
        return np.where(m_arr > 0, self.gpu_overhead_s + self._gpu_roofline(m_arr), 0.0)

    def count_times(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(t_g, t_c, t_g_shares), each float64 [n], of integer token counts `tokens` int [n] (a layer's tokens per
        expert): looked up in tables of every count up to the largest seen, made by the elementwise calls themselves
        (so the same values) and remade whenever a cost parameter they read has changed. A plan asks for the times of
        every expert of its layer (128 at Qwen3-30B); three gathers cost a few µs where the elementwise calls cost
        ~20 numpy operations at every plan."""
        key = (self.gpu_overhead_s, self.call_overhead_s, self.expert_flops, self._expert_gpu_flops, self.expert_bytes,
               self._gpu_bw, self.beta_s, self.cpu_startup_s)
        top = int(tokens.max(initial=0))
        tables = self.__dict__.get("_count_tables")
        if tables is None or tables[0] != key or tables[1].size <= top:
            counts = np.arange(max(2 * top, 64) + 1, dtype=np.float64)
            tables = self.__dict__["_count_tables"] = (key, np.atleast_1d(self.t_g(counts)),
                                                      np.atleast_1d(self.t_c(counts)), self.t_g_shares(counts))
        return tables[1][tokens], tables[2][tokens], tables[3][tokens]

    def t_g_group(self, m: np.ndarray) -> np.ndarray:
        """float [n]: per-expert GPU times of experts run together in one call (the first carries the
        call's dispatch, the others only their own work); 0 where m == 0."""
        m_arr = np.atleast_1d(np.asarray(m, dtype=np.float64))
        return self.with_dispatch(self.t_g_shares(m_arr), m_arr)

    def with_dispatch(self, shares: np.ndarray, m: ArrayLike) -> np.ndarray:
        """float64 [n]: `shares` (each expert's `t_g_shares` in a call) with the call's dispatch added to the first
        expert that has tokens (`m` > 0): the per-expert times `t_g_group` gives."""
        out = np.array(shares, dtype=np.float64)
        if isinstance(m, list):  # a plan's few experts: the first live one without numpy's per-call overhead
            first = next((i for i, x in enumerate(m) if x > 0), None)
        else:
            live = np.flatnonzero(np.atleast_1d(np.asarray(m)) > 0)
            first = int(live[0]) if live.size else None
        if first is not None:
            out[first] += self.call_overhead_s
        return out

    def t_g_group_sum(self, ms: Sequence[float]) -> float:
        """`sum(t_g_group(ms))` without numpy (the schedulers' per-layer path): each live expert's `t_g`,
        the call's dispatch paid once."""
        live = [m for m in ms if m > 0]
        return sum(self.t_g(m) for m in live) - (len(live) - 1) * self.call_overhead_s if live else 0.0

    def _gpu_block(self, flops: float, nbytes: float, kernels: int = 1) -> float:
        return kernels * self.gpu_overhead_s + max(flops / self._gpu_flops, nbytes / self._gpu_bw)

    def t_attn(self, batch: int, ctx: int, prefill: bool = False, prompt_len: int = 0) -> float:
        """Attention block of one decoder layer, gate included.

        Decode: `batch` new tokens attend over `ctx` cached positions each. Prefill: `batch`
        sequences of `prompt_len` tokens attend causally (ctx is ignored).
        """
        cfg, bpp = self.cfg, self.bytes_per_param
        if cfg.uses_mla:
            qk_dim, v_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
        else:
            qk_dim = v_dim = cfg.attn_head_dim
        heads = cfg.num_attention_heads
        if prefill:
            tokens = batch * prompt_len
            pairs = batch * prompt_len * (prompt_len + 1) / 2
            kv_read = tokens * self._kv_bytes
        else:
            tokens = batch
            pairs = batch * ctx
            kv_read = batch * ctx * self._kv_bytes
        params = self._attn_params + cfg.num_experts * cfg.hidden_size
        flops = 2 * params * tokens + 2 * pairs * heads * (qk_dim + v_dim)
        nbytes = params * bpp + kv_read + 2 * tokens * cfg.hidden_size * bpp
        return self._gpu_block(flops, nbytes, kernels=2)

    def t_dense_mlp(self, tokens: int) -> float:
        """The dense MLP of a non-MoE decoder layer (DeepSeek's first layer)."""
        params = 3 * self.cfg.hidden_size * self.cfg.intermediate_size
        return self._gpu_block(2 * params * tokens, params * self.bytes_per_param)

    def t_shared(self, tokens: int) -> float:
        """The shared expert(s) of one MoE layer on the GPU (0 where the family has none)."""
        if not self._shared_params:
            return 0.0
        return self._gpu_block(2 * self._shared_params * tokens, self._shared_params * self.bytes_per_param)

    def t_head(self, tokens: int) -> float:
        """Final norm + LM head for `tokens` output positions."""
        params = self.cfg.vocab_size * self.cfg.hidden_size
        return self._gpu_block(2 * params * tokens, params * self.bytes_per_param)

    # online calibration (the Timer of LayerScope §4.1) -----------------------------------------
    def update_transfer(self, seconds: float) -> None:
        """A measured expert transfer time."""
        self.t_io = (1 - self.ema) * self.t_io + self.ema * float(seconds)

    def update_cpu(self, tokens: int, seconds: float) -> None:
        """A measured CPU expert time for `tokens` tokens: refits eq. 2 once the token counts seen span
        enough to pin the slope; until then only the intercept C follows (moving average)."""
        fit = self._cpu_fit.add(tokens, seconds)
        if fit is not None:
            self.beta_s, self.cpu_startup_s = fit
        else:
            c = max(float(seconds) - self.beta_s * float(tokens), 0.0)
            self.cpu_startup_s = (1 - self.ema) * self.cpu_startup_s + self.ema * c

    def update_gpu(self, tokens: int, seconds: float) -> None:
        """A measured GPU expert time (one expert, one call); the per-call dispatch absorbs the error of
        the roofline and the per-expert kernel cost."""
        overhead = max(float(seconds) - float(self._gpu_roofline(tokens)) - self.gpu_overhead_s, 0.0)
        if self._gpu_samples is None:  # the prior (profile) value weighs as GPU_PRIOR_SAMPLES samples
            self._gpu_samples = collections.deque([self.call_overhead_s] * GPU_PRIOR_SAMPLES, maxlen=GPU_WINDOW)
        self._gpu_samples.append(overhead)
        self.call_overhead_s = statistics.median(self._gpu_samples)

    def update_cpu_dispatch(self, seconds: float) -> None:
        """A measured hand-over of a layer's CPU side (its wall time minus the experts' own compute)."""
        self.cpu_dispatch_s = (1 - self.ema) * self.cpu_dispatch_s + self.ema * max(float(seconds), 0.0)

    def update_layer_overhead(self, seconds: float) -> None:
        """A measured fixed host time of one MoE layer (its wall time up to the plan, minus t_attn)."""
        self.layer_overhead_s = (1 - self.ema) * self.layer_overhead_s + self.ema * max(float(seconds), 0.0)

    def update_pass_overhead(self, seconds: float) -> None:
        """A measured fixed host time of one forward pass (outside its layers, minus the modelled head)."""
        self.pass_overhead_s = (1 - self.ema) * self.pass_overhead_s + self.ema * max(float(seconds), 0.0)

    def summary(self) -> dict[str, float]:
        """The per-expert numbers in milliseconds (results.json, reports)."""
        return {"t_io_ms": self.t_io * 1e3, "t_g_1_ms": self.t_g(1) * 1e3, "cpu_beta_ms": self.beta_s * 1e3,
                "cpu_startup_ms": self.cpu_startup_s * 1e3, "call_overhead_ms": self.call_overhead_s * 1e3,
                "layer_overhead_ms": self.layer_overhead_s * 1e3, "cpu_dispatch_ms": self.cpu_dispatch_s * 1e3, "pass_overhead_ms": self.pass_overhead_s * 1e3,
                "expert_mib": self.expert_bytes / 2**20, **self.format.summary()}
