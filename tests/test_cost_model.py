"""Cost model and hardware profiles against LayerScope's published numbers (Table 2, Table 3, §5.1)."""

from __future__ import annotations

import numpy as np
import pytest

from conf import compose
from schedulers.hardware import HardwareProfile, load_hardware
from models.loading import resolve_model_config
from schedulers.cost import CostModel, _RunningFit, memory_plan, non_expert_params

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
    # the work beyond the fixed per-call cost (1.1 ms in the calibrated profile) goes from weight reads to GEMMs
    assert big - cost.gpu_overhead_s > 20 * (small - cost.gpu_overhead_s)
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


def test_cpu_refit_equals_least_squares_over_the_window() -> None:
    """Eq. 2's online refit keeps running sums; after each sample it must equal np.polyfit over the
    last `window` samples (prefill-sized and decode-sized token counts mixed, the window overrun)."""
    fit = _RunningFit(window=64, min_span=16.0)
    rng = np.random.default_rng(3)
    xs: list[float] = []
    ys: list[float] = []
    fitted = 0
    for i in range(400):
        x = float(rng.integers(1, 9) if rng.random() < 0.8 else rng.integers(16, 600))
        y = 2e-6 * x + 4e-5 + rng.normal(0, 1e-5)
        xs, ys = (xs + [x])[-64:], (ys + [y])[-64:]
        got = fit.add(x, y)
        if np.ptp(xs) < 16.0:
            assert got is None
            continue
        a, b = np.polyfit(xs, ys, 1)
        assert got == pytest.approx((max(a, 0.0), max(b, 0.0)), rel=1e-6, abs=1e-12)
        fitted += 1
    assert 50 < fitted < 400  # both branches ran


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


def _with_gpu(hw: HardwareProfile, **fields) -> HardwareProfile:
    import dataclasses

    return dataclasses.replace(hw, gpu=dataclasses.replace(hw.gpu, **fields))


def test_paper_profiles_charge_no_executor_overheads() -> None:
    for name in PROFILES:  # LayerScope gives no per-call / per-layer host numbers: they are 0, documented
        gpu = load_hardware(name).gpu
        assert gpu.call_overhead_us == gpu.layer_overhead_us == gpu.pass_overhead_us == 0.0
    with pytest.raises(ValueError, match="gpu.layer_overhead_us"):
        _with_gpu(load_hardware("v100_pcie3"), layer_overhead_us=-1.0)


def test_only_the_cpu_backend_profile_copies_and_computes_on_the_host_cores() -> None:
    import dataclasses

    for name in PROFILES:  # PCIe to a GPU: a DMA engine copies, the GPU computes, the host cores stay free
        cost = CostModel(model("mixtral_8x7b"), load_hardware(name))
        assert cost.link_cpu_share == 0.0 and cost.device_cpu_share == 0.0
    local = load_hardware("local_cpu")
    assert local.host_link.host_cpu_share == 1.0 and local.gpu.host_cpu_share == 1.0
    with pytest.raises(ValueError, match="host_link.host_cpu_share"):
        dataclasses.replace(local, host_link=dataclasses.replace(local.host_link, host_cpu_share=1.5))
    with pytest.raises(ValueError, match="gpu.host_cpu_share"):
        _with_gpu(local, host_cpu_share=-0.1)


def test_one_call_for_a_group_pays_the_dispatch_once() -> None:
    hw = _with_gpu(load_hardware("a100_pcie4"), call_overhead_us=200.0)
    cost = CostModel(model("qwen3_30b_a3b"), hw)
    m = np.array([3, 0, 1, 5])
    alone = np.atleast_1d(cost.t_g(m))
    group = cost.t_g_group(m)
    assert alone[0] == pytest.approx(cost.t_g(3)) and group[1] == 0.0
    # three live experts in one call: two dispatches fewer than three calls of their own
    assert alone.sum() - group.sum() == pytest.approx(2 * 200e-6)
    assert group[0] - group[2] == pytest.approx(200e-6 + float(cost._gpu_roofline(3) - cost._gpu_roofline(5)))
    assert cost.t_g_group_sum(m.tolist()) == pytest.approx(group.sum()) and cost.t_g_group_sum([0, 0]) == 0.0
    slow = cost.t_g(1) + 3e-3
    for _ in range(2):  # a stray pair of slow single-expert calls does not move the dispatch estimate
        cost.update_gpu(1, slow)
    assert cost.call_overhead_s == pytest.approx(200e-6)
    for _ in range(10):  # consistently slower calls do: the estimate follows them
        cost.update_gpu(1, slow)
    assert cost.call_overhead_s == pytest.approx(200e-6 + 3e-3)


def test_measured_overheads_override_and_the_timer_ema_tracks_them() -> None:
    hw = load_hardware("v100_pcie3")
    prof = HardwareProfile(name="m", gpu=hw.gpu, cpu=hw.cpu, host_link=hw.host_link,
                           measured={"q": {"layer_overhead_ms": 0.5, "pass_overhead_ms": 2.0, "call_overhead_ms": 0.1}})
    cost = CostModel(model("qwen3_30b_a3b"), prof, model_name="q")
    assert (cost.layer_overhead_s, cost.pass_overhead_s, cost.call_overhead_s) == pytest.approx((5e-4, 2e-3, 1e-4))
    for _ in range(60):
        cost.update_layer_overhead(1e-3)
        cost.update_pass_overhead(4e-3)
    assert cost.layer_overhead_s == pytest.approx(1e-3, rel=1e-3) and cost.pass_overhead_s == pytest.approx(4e-3, rel=1e-3)


def test_the_simulator_charges_the_fixed_host_times_per_layer_and_pass() -> None:
    from engine.sim.run import RunSpec, simulate
    from schedulers.offload.ktransformers import KTransformersSettings

    cfg = model("mixtral_8x7b").replace(num_hidden_layers=3)
    base = load_hardware("a100_pcie4")
    every = cfg.num_experts * len(cfg.moe_layers)

    def decode_s(hw: HardwareProfile) -> tuple[float, float]:
        spec = RunSpec(model=cfg, model_name="m3", hardware=hw, batch_size=2, prompt_len=8, gen_len=4,
                       scheduler=KTransformersSettings(label="k"), cache_slots=every)
        out = simulate(spec)  # everything resident: no transfer, the overheads add up exactly
        return out.summary["decode_latency_s"], out.summary["prefill_s"]

    d0, p0 = decode_s(base)
    d1, p1 = decode_s(_with_gpu(base, layer_overhead_us=300.0, pass_overhead_us=1000.0))
    assert d1 - d0 == pytest.approx(3 * 300e-6 + 1000e-6, rel=1e-6)
    assert p1 - p0 == pytest.approx(3 * 300e-6 + 1000e-6, rel=1e-6)


def test_the_cpu_hand_over_is_paid_once_per_layer() -> None:
    import dataclasses

    hw = load_hardware("v100_pcie3")
    hw = dataclasses.replace(hw, cpu=dataclasses.replace(hw.cpu, dispatch_us=400.0))
    cost = CostModel(model("deepseek_v2_lite"), hw)
    m = np.array([0, 2, 7])
    per_expert = float(cost.t_c(2) + cost.t_c(7))
    assert cost.t_c_sum(m) == pytest.approx(per_expert + 400e-6)
    assert cost.t_c_sum(np.array([0, 0])) == 0.0
    assert cost.t_c_prefix(m) == pytest.approx([0.0, cost.t_c(2) + 400e-6, per_expert + 400e-6])
    for _ in range(60):
        cost.update_cpu_dispatch(1e-4)
    assert cost.cpu_dispatch_s == pytest.approx(1e-4, rel=1e-3)


def test_decode_sized_cpu_samples_move_the_intercept_not_the_slope() -> None:
    cost = CostModel(model("deepseek_v2_lite"), load_hardware("v100_pcie3"))
    beta = cost.beta_s
    rng = np.random.default_rng(0)
    for _ in range(100):  # 1-8 tokens with noise larger than the slope: the slope must not collapse to 0
        m = int(rng.integers(1, 9))
        cost.update_cpu(m, 3e-3 - 1e-4 * m + rng.normal(0, 2e-4))
    assert cost.beta_s == beta
    assert cost.cpu_startup_s == pytest.approx(3e-3 - 4.5e-4 - 4.5 * beta, abs=3e-4)
