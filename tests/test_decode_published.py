"""The serverless layer time's fitted constants (engine/bench/check_decode_published.py): fitted on the published
points marked `fit` only, recovered exactly from steps the model itself produced, and the ones the A6000 profile
carries."""

from __future__ import annotations

import copy

import pytest

from engine.bench import check_decode_published as check
from schedulers.hardware import load_hardware


def test_fit_uses_only_its_points_recovers_known_constants_and_is_the_a6000_profiles():
    hw = load_hardware("a6000")
    points = check.load_points()
    roles = {p["role"] for p in points}
    assert roles == {"fit", "held_out"}
    fitted = check.fit(points, hw)
    assert fitted["fitted_on"] == [p["id"] for p in points if p["role"] == "fit"]

    # a held-out point moves nothing; a fitted one moves the constants
    moved = copy.deepcopy(points)
    next(p for p in moved if p["role"] == "held_out")["step_ms"] *= 3
    assert check.fit(moved, hw)["hbm_efficiency"] == pytest.approx(fitted["hbm_efficiency"], rel=1e-12)
    next(p for p in moved if p["role"] == "fit")["step_ms"] *= 1.2
    assert check.fit(moved, hw)["hbm_efficiency"] != pytest.approx(fitted["hbm_efficiency"], rel=1e-3)

    # steps made by the cost model at known constants are fitted back to them (weight streaming and fixed costs both)
    synthetic = copy.deepcopy(points)
    for p in synthetic:
        p["step_ms"] = check.modelled_step_s(p, hw, efficiency=0.7, overhead_us=12.0)[0] * 1e3
    back = check.fit(synthetic, hw)
    assert back["hbm_efficiency"] == pytest.approx(0.7, rel=1e-9)
    assert back["kernel_overhead_us"] == pytest.approx(12.0, rel=1e-9)

    # the A6000 profile carries the fitted constants (rounded as written there)
    assert hw.gpu.hbm_efficiency == pytest.approx(fitted["hbm_efficiency"], abs=5e-4)
    assert hw.gpu.kernel_overhead_us == pytest.approx(fitted["kernel_overhead_us"], abs=5e-3)
