"""Schema of the `hardware` group: one machine (GPU(s), host CPU, host link, device interconnect).

A profile is a YAML file in `conf/hardware/` whose every number carries its source in a comment
(vendor datasheet, LayerScope §5.1 / Table 2, MoEless §5). The cost model of the schedulers
(`schedulers/cost.py`) and the simulators read it; `calibrate` (later) writes measured profiles in
the same schema. Units are in the field names: GB/s = 1e9 bytes per second, GiB = 2**30 bytes,
TFLOP/s = 1e12, µs / ms as named.

| block          | field                       | meaning                                                      |
|----------------|-----------------------------|--------------------------------------------------------------|
| (top)          | name                        | profile id (the YAML file's stem)                            |
|                | num_devices                 | accelerators in the machine (expert parallelism spans them)  |
| `gpu`          | name                        | product name                                                 |
|                | memory_gib                  | physical device memory                                       |
|                | usable_memory_gib           | cap the experiments impose (LayerScope §5.1: 24 GB); None = physical |
|                | bf16_tflops                 | dense bf16 tensor-core peak (V100: fp16, it has no bf16 units) |
|                | hbm_gbps                    | device-memory bandwidth peak                                 |
|                | matmul_efficiency           | achieved fraction of bf16_tflops on expert / attention GEMMs |
|                | hbm_efficiency              | achieved fraction of hbm_gbps on weight-streaming GEMVs      |
|                | kernel_overhead_us          | fixed cost of one expert (or one attention block) on the GPU: launches + framework dispatch |
|                | call_overhead_us            | fixed cost of one host -> device call of the expert kernel (the executor runs the resident experts of a layer in one call, each on-demand load in its own): Python/jit dispatch, argument transfer. 0 in the paper's profiles (LayerScope gives no number; CUDA launches are in kernel_overhead_us) |
|                | layer_overhead_us           | fixed host time per MoE layer of the offload executor beyond attention: router output to the host (a device sync), LayerState, planning, issuing the plan. 0 in the paper's profiles |
|                | pass_overhead_us            | fixed host time per forward pass beyond the modelled blocks: embedding, mask preparation, logits to the host. 0 in the paper's profiles |
|                | reserved_gib                | memory held by the runtime (CUDA context, allocator slack, activation workspace) |
|                | host_cpu_share              | fraction of the device's compute time it takes from the host cores: 0 for a GPU (every GPU profile), 1 where the device is the host itself (`calibrate` on the CPU backend: device and CPU experts share the cores, so they do not run side by side) |
| `cpu`          | name, sockets, cores        | the host processor(s) that run CPU experts                   |
|                | peak_gflops                 | fp32 FMA peak of the cores used, all sockets                 |
|                | memory_gbps                 | DRAM bandwidth peak, all sockets                             |
|                | matmul_efficiency           | achieved fraction of peak_gflops by CPU expert GEMMs         |
|                | memory_efficiency           | achieved fraction of memory_gbps when streaming expert weights |
|                | expert_overhead_us          | fixed cost of one CPU expert call (thread-pool wake-up, dispatch) |
|                | dispatch_us                 | fixed cost per layer of the CPU side as a whole: handing the layer's CPU experts to the worker and merging their output back into the device computation. 0 in the paper's profiles |
| `host_link`    | name                        | e.g. "PCIe 3.0 x16"                                          |
|                | peak_gbps                   | theoretical one-direction bandwidth host -> device           |
|                | efficiency                  | fraction of peak a pinned, chunked, asynchronous copy reaches |
|                | latency_us                  | fixed cost per expert transfer (issue, chunk synchronisation) |
|                | sync_copy_slowdown          | how much longer a synchronous pageable copy takes (no AsyncIO) |
|                | host_cpu_share              | fraction of a transfer's time it takes from the host cores: 0 with a DMA engine (every GPU profile), 1 where a host thread copies (`calibrate` on the CPU backend) |
| `interconnect` | name                        | device-to-device fabric ("none" on one device)               |
|                | gbps_per_device             | one-direction bandwidth each device gets in an all-to-all    |
|                | latency_us                  | per-message latency of a collective step                     |
|                | pair_gbps                   | one-direction bandwidth to a directly bridged peer (NVLink pairs); 0 if none |
| `measured`     | {model name: ExpertTimes}   | measured per-expert times that override the modelled ones    |
| `block_rates`  | {block type: BlockRates}    | an expert format's CPU / GPU rates relative to bf16 on this machine (`schedulers/formats.py`); empty: the rates measured on moescope's development machine, `schedulers/data/block_rates.yaml` |

The expert transfer time is `latency_us + bytes / (peak_gbps * efficiency)`: with one efficiency and one
latency for both links, fitted on two PCIe 3.0 points of LayerScope Table 2 (`python -m engine.calibrate_paper`),
`v100_pcie3` / `a100_pcie4` reproduce the four held-out ones (Mixtral 13.98 ms, DeepSeek 0.76 ms, Qwen3 0.79 /
0.44 ms) within 5%.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Dict, Optional

from omegaconf import MISSING

from core.config import unfrozen, store


@dataclass(frozen=True)
class GpuSpec:
    name: str = "gpu"
    memory_gib: float = 24.0
    usable_memory_gib: Optional[float] = None
    bf16_tflops: float = 100.0
    hbm_gbps: float = 1000.0
    matmul_efficiency: float = 0.6
    hbm_efficiency: float = 0.8
    kernel_overhead_us: float = 30.0
    reserved_gib: float = 1.5
    call_overhead_us: float = 0.0
    layer_overhead_us: float = 0.0
    pass_overhead_us: float = 0.0
    # fraction of the device's compute time it also takes from the host cores: 0 for a GPU, 1 where the
    # "device" is the host (the CPU backend: its expert calls and the torch CPU experts share the cores)
    host_cpu_share: float = 0.0

    @property
    def budget_bytes(self) -> float:
        """Device memory the engine may use: the usable cap (or the physical size) minus the reserve."""
        cap = self.usable_memory_gib if self.usable_memory_gib is not None else self.memory_gib
        return (cap - self.reserved_gib) * 2**30


@dataclass(frozen=True)
class CpuSpec:
    name: str = "cpu"
    sockets: int = 1
    cores: int = 8
    peak_gflops: float = 500.0
    memory_gbps: float = 50.0
    matmul_efficiency: float = 0.3
    memory_efficiency: float = 0.7
    expert_overhead_us: float = 100.0
    dispatch_us: float = 0.0


@dataclass(frozen=True)
class HostLink:
    name: str = "PCIe 4.0 x16"
    peak_gbps: float = 31.5
    efficiency: float = 0.8
    latency_us: float = 50.0
    sync_copy_slowdown: float = 1.7
    # fraction of a transfer's time it also takes from the host's cores: 0 where a DMA engine copies (PCIe
    # to a GPU), 1 where a host thread does the copy (the CPU backend: the "device" is host memory)
    host_cpu_share: float = 0.0

    def transfer_s(self, nbytes: float) -> float:
        """Seconds to move `nbytes` host -> device with pinned asynchronous chunked copies."""
        return self.latency_us * 1e-6 + nbytes / (self.peak_gbps * 1e9 * self.efficiency)


@dataclass(frozen=True)
class Interconnect:
    name: str = "none"
    gbps_per_device: float = 0.0
    latency_us: float = 0.0
    pair_gbps: float = 0.0


@dataclass(frozen=True)
class ExpertTimes:
    """Measured per-expert times of one model on this machine (None: use the modelled value)."""

    transfer_ms: Optional[float] = None  # t_io
    gpu_ms: Optional[float] = None  # t_g at one token
    cpu_beta_ms: Optional[float] = None  # eq. 2 slope per token
    cpu_startup_ms: Optional[float] = None  # eq. 2 intercept C
    call_overhead_ms: Optional[float] = None  # one expert-kernel call (dispatch), see GpuSpec.call_overhead_us
    layer_overhead_ms: Optional[float] = None  # host time per MoE layer, see GpuSpec.layer_overhead_us
    pass_overhead_ms: Optional[float] = None  # host time per forward pass, see GpuSpec.pass_overhead_us
    cpu_dispatch_ms: Optional[float] = None  # a layer's CPU side handed over and merged back, see CpuSpec.dispatch_us
    # the experts these times were measured on: their format (schedulers/formats.py; None: bf16, the run dtype's
    # experts) and one expert's MiB (None: the model's experts at the cost model's bytes per parameter). A run in
    # another format scales them: the transfer by the bytes, eq. 2 by the block types' rates
    expert_format: Optional[str] = None
    expert_mib: Optional[float] = None


@dataclass(frozen=True)
class BlockRates:
    """How one ggml block type (`models.quant.blocks`) changes an expert's times against bf16 on one machine, for
    the same weights (`schedulers/formats.py` combines a layer's gate/up and down types):

    - `cpu_beta_scale`: eq. 2's per-token slope (the kernel's compute per weight: dequantizing, int8 dots);
    - `cpu_read_scale`: the time to stream the expert's weights once (eq. 2's intercept less the call overhead),
      against bf16's; below the bytes ratio is impossible, above it the kernel is not bound by memory at m = 1;
    - `gpu_compute_scale`: the GPU GEMM's compute time (dequantized inside the kernel) against bf16's; the GPU's
      streaming time follows the format's bytes."""

    cpu_beta_scale: float = 1.0
    cpu_read_scale: float = 1.0
    gpu_compute_scale: float = 1.0


@dataclass(frozen=True)
class HardwareProfile:
    name: str = MISSING
    num_devices: int = 1
    gpu: GpuSpec = field(default_factory=GpuSpec)
    cpu: CpuSpec = field(default_factory=CpuSpec)
    host_link: HostLink = field(default_factory=HostLink)
    interconnect: Interconnect = field(default_factory=Interconnect)
    measured: Dict[str, ExpertTimes] = field(default_factory=dict)
    block_rates: Dict[str, BlockRates] = field(default_factory=dict)  # empty: schedulers/data/block_rates.yaml

    def __post_init__(self) -> None:
        measured = {str(k): v if isinstance(v, ExpertTimes) else ExpertTimes(**dict(v)) for k, v in self.measured.items()}
        object.__setattr__(self, "measured", measured)
        rates = {str(k): v if isinstance(v, BlockRates) else BlockRates(**dict(v)) for k, v in self.block_rates.items()}
        object.__setattr__(self, "block_rates", rates)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the key of a physically impossible number."""

        def need(cond: bool, key: str, msg: str) -> None:
            if not cond:
                raise ValueError(f"hardware {self.name}: {key}: {msg}")

        need(self.name not in ("", "???"), "name", "is required (the profile id)")
        need(self.num_devices >= 1, "num_devices", f"must be >= 1, got {self.num_devices}")
        need(self.cpu.sockets >= 1, "cpu.sockets", f"must be >= 1, got {self.cpu.sockets}")
        for key, value in numeric_fields(self):
            need(math.isfinite(value) and value >= 0, key, f"must be a finite number >= 0, got {value}")
        for key in ("cpu.dispatch_us", "gpu.call_overhead_us", "gpu.layer_overhead_us", "gpu.pass_overhead_us", "gpu.kernel_overhead_us",
                    "host_link.latency_us"):
            block, attr = key.split(".")
            value = getattr(getattr(self, block), attr)
            need(value >= 0, key, f"must be >= 0, got {value}")
        for key in ("gpu.memory_gib", "gpu.bf16_tflops", "gpu.hbm_gbps", "cpu.cores", "cpu.peak_gflops",
                    "cpu.memory_gbps", "host_link.peak_gbps"):
            block, attr = key.split(".")
            value = getattr(getattr(self, block), attr)
            need(value > 0, key, f"must be positive, got {value}")
        for key in ("gpu.matmul_efficiency", "gpu.hbm_efficiency", "cpu.matmul_efficiency",
                    "cpu.memory_efficiency", "host_link.efficiency"):
            block, attr = key.split(".")
            value = getattr(getattr(self, block), attr)
            need(0 < value <= 1, key, f"must lie in (0, 1], got {value}")
        if self.gpu.usable_memory_gib is not None:
            need(0 < self.gpu.usable_memory_gib <= self.gpu.memory_gib, "gpu.usable_memory_gib",
                 f"{self.gpu.usable_memory_gib} must lie in (0, memory_gib={self.gpu.memory_gib}]")
        need(self.gpu.budget_bytes > 0, "gpu.reserved_gib", "leaves no device memory")
        need(self.host_link.sync_copy_slowdown >= 1, "host_link.sync_copy_slowdown", "must be >= 1")
        for name, rates in self.block_rates.items():
            for f in fields(rates):
                need(getattr(rates, f.name) > 0, f"block_rates.{name}.{f.name}", f"must be positive, got {getattr(rates, f.name)}")
        for key in ("gpu.host_cpu_share", "host_link.host_cpu_share"):
            block, attr = key.split(".")
            value = getattr(getattr(self, block), attr)
            need(0 <= value <= 1, key, f"must lie in [0, 1], got {value}")
        if self.num_devices > 1:
            need(self.interconnect.gbps_per_device > 0, "interconnect.gbps_per_device",
                 f"must be positive with num_devices={self.num_devices}")


store(unfrozen(HardwareProfile), name="base_hardware", group="hardware")

# no default fits every machine: a profile must state these (the rest default as in the dataclasses above, and
# every default a run used is reported in its results as `hardware_defaults`)
REQUIRED_KEYS = ("name", "gpu.memory_gib", "gpu.bf16_tflops", "gpu.hbm_gbps", "cpu.cores", "cpu.peak_gflops",
                 "cpu.memory_gbps", "host_link.peak_gbps")


def _blocks(profile: HardwareProfile) -> list[tuple[str, Any]]:
    """(key prefix, block) of every block of numbers in a profile, the top level and measured times included."""
    named = [("", profile)] + [(f"{name}.", getattr(profile, name)) for name in ("gpu", "cpu", "host_link", "interconnect")]
    return (named + [(f"measured.{model}.", times) for model, times in profile.measured.items()]
            + [(f"block_rates.{name}.", rates) for name, rates in profile.block_rates.items()])


def numeric_fields(profile: HardwareProfile) -> list[tuple[str, float]]:
    """(dotted key, value) of every number in the profile, the measured times included (None skipped)."""
    return [(prefix + f.name, float(value)) for prefix, block in _blocks(profile) for f in fields(block)
            if isinstance(value := getattr(block, f.name), (int, float)) and not isinstance(value, bool)]


def leaf_defaults() -> dict[str, object]:
    """Every settable key of a profile (name and measured times aside) with its dataclass default."""
    base = HardwareProfile(name="defaults")  # no measured times: its blocks are the top level and the four specs
    return {"num_devices": base.num_devices} | {prefix + f.name: getattr(block, f.name)
                                                 for prefix, block in _blocks(base)[1:] for f in fields(block)}


def given_keys(node: Any) -> set[str]:
    """Dotted keys a YAML node (or dict) sets."""
    from omegaconf import DictConfig, OmegaConf

    data = OmegaConf.to_container(node, resolve=False) if isinstance(node, DictConfig) else dict(node)
    keys: set[str] = set()
    for key, value in data.items():
        if isinstance(value, dict) and key not in ("measured", "block_rates"):
            keys |= {f"{key}.{k}" for k in value}
        else:
            keys.add(str(key))
    return keys


def settle_profile(node: Any, given: Optional[set[str]], source: str) -> tuple[HardwareProfile, dict[str, object]]:
    """The frozen, validated profile of a composed `hardware` node and the defaults it took; `given` are the keys
    its YAML file and the command line set (None: unknown, nothing is checked or reported). Errors name `source`
    (the file) and the key."""
    from core.config import to_frozen

    defaults: dict[str, object] = {}
    if given is not None:
        missing = [k for k in REQUIRED_KEYS if k not in given]
        if missing:
            raise ValueError(f"{source}: {missing[0]} is required in a hardware profile (no default fits every "
                             f"machine); also required: {', '.join(k for k in REQUIRED_KEYS if k != missing[0])}")
        defaults = {k: v for k, v in leaf_defaults().items() if k not in given}
    try:
        return to_frozen(node, HardwareProfile), defaults
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source}: {exc}") from None


def composed_profile(node: Any) -> tuple[HardwareProfile, dict[str, object]]:
    """`settle_profile` for the `hardware` node of a Hydra app: the keys given are those of the chosen file
    (conf/hardware/<choice>.yaml) and the `hardware.*` overrides on the command line."""
    from pathlib import Path

    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from core.config import CONF_DIR

    if not HydraConfig.initialized():
        return settle_profile(node, None, f"hardware {node.get('name')}")
    hc = HydraConfig.get()
    choice = hc.runtime.choices.get("hardware")
    path = Path(choice) if choice and choice.endswith((".yaml", ".yml")) else CONF_DIR / "hardware" / f"{choice}.yaml"
    given = given_keys(OmegaConf.load(path)) if path.is_file() else set()
    for override in hc.overrides.task:
        key = override.lstrip("+~").split("=", 1)[0]
        if key.startswith("hardware."):
            given.add(key[len("hardware."):])
    return settle_profile(node, given, f"hardware={choice} ({path})")


def load_hardware(name: str) -> HardwareProfile:
    """The profile `conf/hardware/<name>.yaml` (or the YAML file at path `name`, such as one `engine.calibrate`
    wrote) as a frozen, validated `HardwareProfile` (tests, notebooks, benchmarks)."""
    from pathlib import Path

    from omegaconf import OmegaConf

    from core.config import CONF_DIR

    path = Path(name) if name.endswith((".yaml", ".yml")) else CONF_DIR / "hardware" / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in (CONF_DIR / "hardware").glob("*.yaml"))
        raise FileNotFoundError(f"hardware={name}: no {path}; known profiles: {known}")
    schema = OmegaConf.structured(unfrozen(HardwareProfile))
    node = OmegaConf.load(path)
    node.pop("defaults", None)
    return settle_profile(OmegaConf.merge(schema, node), given_keys(node), str(path))[0]
