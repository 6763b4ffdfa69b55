"""The cost model knows the experts' format (issue 28 item 7): bytes per expert from ggml's block layouts,
CPU time per token from the measured per-type kernel rates (schedulers/data/block_rates.yaml), the cache's
capacity for the same memory, and `engine.simulate`'s `model.expert_format`."""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import pytest

from conf import compose
from models.loading import resolve_model_config
from schedulers.cost import CostModel, memory_plan
from schedulers.formats import expert_format_bytes, measured_block_rates
from schedulers.hardware import BlockRates, load_hardware

H, F, LAYERS = 4096, 14336, 32  # Mixtral-8x7B


@lru_cache(maxsize=1)
def mixtral():
    return resolve_model_config(compose("simulate", ["model=mixtral_8x7b"]).model)


def more_bits(layer: int, n: int = LAYERS) -> bool:
    """llama.cpp's *_K_M rule, written out again here: first and last eighth, every third layer between."""
    return layer < n // 8 or layer >= 7 * n // 8 or (layer - n // 8) % 3 == 2


def q4_k_m_bytes() -> float:
    """Mixtral's mean Q4_K_M expert from ggml's block sizes: Q4_K 144 B and Q6_K 210 B per 256 weights."""
    gate_up = 2 * F * (H // 256) * 144
    sizes = [gate_up + H * (F // 256) * (210 if more_bits(layer) else 144) for layer in range(LAYERS)]
    return sum(sizes) / LAYERS


def test_expert_bytes_follow_the_blocks() -> None:
    cfg, hw = mixtral(), load_hardware("a100_pcie4")
    assert sum(more_bits(layer) for layer in range(LAYERS)) == 16  # half of Mixtral's layers get Q6_K down
    want = {"bf16": 3 * H * F * 2, "q8_0": 3 * H * F // 32 * 34, "q4_k_m": q4_k_m_bytes()}
    for fmt, nbytes in want.items():
        cost = CostModel(cfg, hw, expert_format=fmt)
        assert cost.expert_bytes == pytest.approx(nbytes, rel=1e-12)
        assert cost.t_io == pytest.approx(hw.host_link.transfer_s(nbytes), rel=1e-12)  # the link moves those bytes
        assert float(cost.t_g(1)) < float(CostModel(cfg, hw).t_g(1)) or fmt == "bf16"  # a GEMV streams fewer
    # Q4_K_M moves ~3.3x fewer bytes than bf16 over the link (Mixtral: 101.7 vs 336 MiB)
    assert want["q4_k_m"] / 2**20 == pytest.approx(101.72, abs=0.01)


def test_cache_holds_more_quantized_experts_in_the_same_memory() -> None:
    cfg, hw = mixtral(), load_hardware("a100_pcie4")
    plans = {fmt: memory_plan(cfg, hw, 64, 512, 64, expert_format=fmt) for fmt in ("bf16", "q8_0", "q4_k_m")}
    for fmt, plan in plans.items():
        free = plan.budget_bytes - plan.non_expert_bytes - plan.kv_cache_bytes - plan.activation_bytes - plan.staging_bytes
        assert plan.expert_bytes == pytest.approx(expert_format_bytes(cfg, fmt), abs=1)
        assert plan.cache_slots == int(free // plan.expert_bytes)
    assert plans["bf16"].cache_slots < plans["q8_0"].cache_slots < plans["q4_k_m"].cache_slots


def test_cpu_time_scales_by_the_measured_rates() -> None:
    cfg, hw = mixtral(), load_hardware("a100_pcie4")
    rates = measured_block_rates()
    bf16 = CostModel(cfg, hw)
    overhead = hw.cpu.expert_overhead_us * 1e-6
    layers = [("q4_k", "q6_k" if more_bits(layer) else "q4_k") for layer in range(LAYERS)]
    for fmt, types in (("q8_0", [("q8_0", "q8_0")] * LAYERS), ("q4_k_m", layers)):
        beta = sum(2 * rates[g].cpu_beta_scale + rates[d].cpu_beta_scale for g, d in types) / (3 * len(types))
        read = sum(2 * rates[g].cpu_read_scale + rates[d].cpu_read_scale for g, d in types) / (3 * len(types))
        cost = CostModel(cfg, hw, expert_format=fmt)
        assert cost.beta_s == pytest.approx(bf16.beta_s * beta, rel=1e-12)
        assert cost.cpu_startup_s == pytest.approx(overhead + (bf16.cpu_startup_s - overhead) * read, rel=1e-12)
        for m in (1, 64):
            assert float(cost.t_c(m)) != pytest.approx(float(bf16.t_c(m)), rel=1e-3)
        assert cost.summary()["expert_format"] == fmt


def test_a_profile_overrides_the_rates_and_bad_ones_name_the_key(tmp_path) -> None:
    from core.config import CONF_DIR

    cfg, hw = mixtral(), load_hardware("a100_pcie4")
    yaml = tmp_path / "mine.yaml"  # a profile file stating its own rates for one type
    yaml.write_text((CONF_DIR / "hardware" / "a100_pcie4.yaml").read_text()
                    + "block_rates:\n  q8_0: {cpu_beta_scale: 3.0, cpu_read_scale: 0.5}\n")
    assert load_hardware(str(yaml)).block_rates["q8_0"] == BlockRates(3.0, 0.5, 1.0)
    base = CostModel(cfg, hw, expert_format="q8_0")
    mine = dataclasses.replace(hw, block_rates={"q8_0": BlockRates(cpu_beta_scale=3.0, cpu_read_scale=0.5,
                                                                   gpu_compute_scale=2.0)})
    cost = CostModel(cfg, mine, expert_format="q8_0")
    assert cost.beta_s == pytest.approx(CostModel(cfg, hw).beta_s * 3.0)
    assert cost.beta_s != pytest.approx(base.beta_s)
    fixed = base.gpu_overhead_s + base.call_overhead_s
    assert float(cost.t_g(4096)) - fixed == pytest.approx(2 * (float(base.t_g(4096)) - fixed))  # compute-bound GEMM
    with pytest.raises(ValueError, match=r"block_rates\.q8_0\.cpu_beta_scale"):
        dataclasses.replace(hw, block_rates={"q8_0": {"cpu_beta_scale": 0.0}})


def test_simulate_takes_model_expert_format() -> None:
    from engine.simulate import spec_from_config
    from engine.sim.run import simulate

    overrides = ["model=mixtral_8x7b", "hardware=a100_pcie4", "batch_size=2", "prompt_len=8", "gen_len=3",
                 "scheduler=fiddler"]
    outs = {}
    for fmt in ("bf16", "q4_k_m"):
        spec = spec_from_config(compose("simulate", overrides + [f"model.expert_format={fmt}"]))
        assert spec.expert_format == fmt
        outs[fmt] = simulate(spec)
    q, b = outs["q4_k_m"], outs["bf16"]
    assert q.summary["cost"]["expert_format"] == "q4_k_m"
    assert q.memory.cache_slots > b.memory.cache_slots
    assert q.cost.t_io < b.cost.t_io / 3
    with pytest.raises(ValueError, match="model.expert_format"):
        spec_from_config(compose("simulate", overrides + ["model.expert_format=q3_k"]))


def test_block_rates_fit_recovers_known_scales() -> None:
    """bench_cpu_experts' fit (what writes block_rates.yaml): times made from known scales give them back, and the
    check lines compare the held-out width and the q4_k_m mix with the measured times."""
    from engine.bench.block_rates_fit import fit_block_rates

    def times(beta: float, c: float) -> dict:  # eq. 2 as the fit reads it: C the time at m = 1, beta the slope
        return {"bytes": 1, "m": {m: {"seconds": c + (beta * m if m > 1 else 0.0)} for m in (1, 4, 16, 64)}}

    widths = {}
    for name, (a, c) in {"mixtral": (8e-3, 40e-3), "qwen3-30b-a3b": (1e-4, 1e-3)}.items():
        widths[name] = {"hidden": 1, "inter": 1, "types": {
            "bf16": times(a, c), "q8_0": times(1.5 * a, 0.6 * c), "q4_k": times(2.0 * a, 0.4 * c),
            "q6_k": times(1.2 * a, 0.5 * c), "q4_k_m/q6_k": times((2 * 2.0 + 1.2) / 3 * a, (2 * 0.4 + 0.5) / 3 * c)}}
    rates, checks = fit_block_rates({"widths": widths})
    assert rates["q4_k"] == pytest.approx({"cpu_beta_scale": 2.0, "cpu_read_scale": 0.4})
    assert rates["q8_0"] == pytest.approx({"cpu_beta_scale": 1.5, "cpu_read_scale": 0.6})
    assert "q4_k_m/q6_k" not in rates  # a mix is checked, not fitted
    mix = next(c for c in checks if c.startswith("qwen3-30b-a3b q4_k_m/q6_k:"))
    predicted = {part.split()[0]: part.split()[1].split("/") for part in mix.split(": ")[1].split(", ")}
    assert sorted(predicted) == ["m1", "m16", "m4", "m64"]
    # eq. 2 counts one token's compute on top of the read at m = 1; beyond it the rescaled line is the measured one
    assert all(abs(float(a) - float(b)) < 0.01 for m, (a, b) in predicted.items() if m != "m1")
