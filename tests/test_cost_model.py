"""Cost model and hardware profiles against LayerScope's published numbers (Table 2, Table 3, §5.1)."""

from __future__ import annotations

import numpy as np
import pytest

from conf import compose
from conf.schemas.hardware import HardwareProfile, load_hardware
from models.loading import resolve_model_config
from schedulers.cost import CostModel, memory_plan, non_expert_params

PROFILES = ["v100_pcie3", "a100_pcie4", "rtx4090", "a6000", "h200_pcie5"]

# LayerScope Table 2: expert transfer cost (ms) after AsyncIO, PCIe 3.0 x16 / PCIe 4.0 x16.
TABLE2 = {"mixtral_8x7b": (26.7, 13.98), "deepseek_v2_lite": (1.39, 0.76), "qwen3_30b_a3b": (0.79, 0.44)}
# LayerScope Table 3: expert memory in bf16 (MB as the paper writes it = MiB).
TABLE3_MIB = {"mixtral_8x7b": 336, "qwen3_30b_a3b": 9, "deepseek_v2_lite": 16.5, "moonlight_16b_a3b": 16.5}


def model(name: str):
    return resolve_model_config(compose("simulate", [f"model={name}"]).model)


@pytest.mark.parametrize("name", sorted(TABLE2))
def test_transfer_times_match_layerscope_table2(name: str) -> None:
    cfg = model(name)
    for hw_name, paper_ms in zip(("v100_pcie3", "a100_pcie4"), TABLE2[name]):
        t_io_ms = CostModel(cfg, load_hardware(hw_name)).t_io * 1e3
        assert abs(t_io_ms / paper_ms - 1) < 0.10, f"{name} on {hw_name}: modelled {t_io_ms:.3f} ms vs paper {paper_ms} ms"


@pytest.mark.parametrize("name", sorted(TABLE3_MIB))
def test_expert_sizes_match_layerscope_table3(name: str) -> None:
    assert model(name).expert_bytes() / 2**20 == pytest.approx(TABLE3_MIB[name], rel=0.01)


@pytest.mark.parametrize("name", PROFILES)
def test_profiles_load_and_are_consistent(name: str) -> None:
    hw = load_hardware(name)
    assert isinstance(hw, HardwareProfile) and hw.name == name
    # the link cannot beat its own peak, and the GPU budget fits the physical memory
    assert hw.host_link.transfer_s(1e9) > 1e9 / (hw.host_link.peak_gbps * 1e9)
    assert hw.gpu.budget_bytes < hw.gpu.memory_gib * 2**30
    if hw.num_devices > 1:
        assert hw.interconnect.gbps_per_device > 0 and hw.interconnect.latency_us > 0


def test_a6000_describes_the_moeless_testbed() -> None:
    hw = load_hardware("a6000")
    assert hw.num_devices == 8 and hw.gpu.memory_gib == pytest.approx(48, abs=0.1)  # MoEless §5
    assert hw.interconnect.pair_gbps > hw.interconnect.gbps_per_device  # NVLink pairs beat PCIe all-to-all


def test_bad_profile_names_the_key() -> None:
    with pytest.raises(ValueError, match="host_link.efficiency"):
        HardwareProfile(name="bad", host_link=load_hardware("v100_pcie3").host_link.__class__(efficiency=1.5))
    with pytest.raises(ValueError, match="interconnect.gbps_per_device"):
        HardwareProfile(name="bad", num_devices=4)
    with pytest.raises(FileNotFoundError, match="known profiles"):
        load_hardware("tpu_v9")


def test_cpu_cost_is_linear_in_tokens_eq2() -> None:
    cost = CostModel(model("mixtral_8x7b"), load_hardware("v100_pcie3"))
    m = np.array([1, 2, 8, 64])
    t = cost.t_c(m)
    slopes = np.diff(t) / np.diff(m)
    assert np.allclose(slopes, cost.beta_s)  # t_c = beta * m + C
    assert t[0] == pytest.approx(cost.beta_s + cost.cpu_startup_s)
    assert cost.t_c(0) == 0.0
    assert cost.t_c_sum(np.array([0, 3, 5])) == pytest.approx(float(cost.t_c(3) + cost.t_c(5)))
    # LayerScope §2.3: CPU time grows with tokens while GPU and PCIe costs stay flat at decode sizes
    assert cost.t_c(16) > 5 * cost.t_c(1) / 2 and cost.t_g(16) < 1.5 * cost.t_g(1)


def test_gpu_time_becomes_compute_bound_in_prefill() -> None:
    cost = CostModel(model("mixtral_8x7b"), load_hardware("a100_pcie4"))
    small, big = cost.t_g(1), cost.t_g(8192)
    assert big > 20 * small
    expected = cost.gpu_overhead_s + 8192 * cost.expert_flops / (312e12 * 0.6)
    assert big == pytest.approx(expected)


def test_attention_grows_with_batch_and_context() -> None:
    cost = CostModel(model("qwen3_30b_a3b"), load_hardware("v100_pcie3"))
    assert cost.t_attn(64, 512) > cost.t_attn(4, 512)
    assert cost.t_attn(64, 4096) > cost.t_attn(64, 512)
    assert cost.t_attn(4, 0, prefill=True, prompt_len=512) > cost.t_attn(4, 512)


def test_online_updates_refit_eq2_and_track_transfers() -> None:
    cost = CostModel(model("deepseek_v2_lite"), load_hardware("v100_pcie3"))
    for m in (1, 4, 16, 64):
        cost.update_cpu(m, 0.002 * m + 0.0005)
    assert cost.beta_s == pytest.approx(0.002) and cost.cpu_startup_s == pytest.approx(0.0005)
    before = cost.t_io
    for _ in range(50):
        cost.update_transfer(2e-3)
    assert cost.t_io == pytest.approx(2e-3, rel=0.01) and before != pytest.approx(2e-3)


def test_measured_times_override_the_model() -> None:
    hw = load_hardware("v100_pcie3")
    measured = HardwareProfile(name="m", gpu=hw.gpu, cpu=hw.cpu, host_link=hw.host_link,
                               measured={"mixtral-8x7b": {"transfer_ms": 30.0, "cpu_beta_ms": 2.0}})
    cost = CostModel(model("mixtral_8x7b"), measured, model_name="mixtral-8x7b")
    assert cost.t_io == pytest.approx(0.030) and cost.beta_s == pytest.approx(0.002)


def test_memory_plan_matches_hand_count_for_mixtral() -> None:
    cfg = model("mixtral_8x7b")
    # embeddings + head 2 * 32000 * 4096, attention 32 * 4096 * (4096 + 2 * 1024 + 4096), gates 32 * 8 * 4096
    assert non_expert_params(cfg) == 2 * 32000 * 4096 + 32 * 4096 * 10240 + 32 * 8 * 4096
    hw = load_hardware("v100_pcie3")
    small, large = memory_plan(cfg, hw, 4, 512, 64), memory_plan(cfg, hw, 64, 512, 64)
    kv64 = 64 * 576 * 32 * 2 * 8 * 128 * 2
    assert large.kv_cache_bytes == kv64
    assert 0 < large.cache_slots < small.cache_slots < 256  # 24 GB cannot hold Mixtral's 256 experts
    with pytest.raises(ValueError, match="cannot hold"):
        memory_plan(cfg, hw, 4096, 4096, 64)
