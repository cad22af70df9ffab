"""The step cost model: non-negative least squares, learned online, calibration kept."""

from __future__ import annotations

import random

import numpy as np
import pytest

from loraplex.server.engine.step_cost import (
    StepCostModel,
    StepShape,
    StepShapeBuilder,
    context_tokens,
    nnls,
)

TRUE = (3e-3, 2e-4, 6e-4, 1e-8, 1e-3, 5e-5)


def law(shape: StepShape) -> float:
    return float(np.dot(TRUE, shape.features()))


def random_shape(rng: random.Random, decode_only: bool = False) -> StepShape:
    return StepShape(0 if decode_only else rng.randint(0, 2048), rng.randint(0, 256),
                     rng.randint(0, 400_000), rng.randint(0, 8),
                     0 if decode_only else rng.choice([0, 0, 40]))


def test_context_tokens_counts_keys_per_query():
    assert context_tokens(100, 1) == 101  # a decode attends its whole context
    assert context_tokens(0, 4) == 1 + 2 + 3 + 4
    assert context_tokens(10, 3) == 11 + 12 + 13


def test_builder_prices_a_row_as_adding_it_would():
    b = StepShapeBuilder()
    b.add(50, 1, True, "a")
    priced = b.with_row(0, 30, False, "b", pages_loaded=7)
    b.add(0, 30, False, "b", pages_loaded=7)
    assert b.shape() == priced == StepShape(30, 1, 51 + 465, 2, 7)
    b.remove(0, 30, False, "b", pages_loaded=7)
    assert b.shape() == StepShape(0, 1, 51, 1, 0)


def test_nnls_recovers_a_nonnegative_law_and_never_goes_negative():
    rng = np.random.default_rng(0)
    x = np.column_stack([np.ones(200), rng.uniform(0, 100, (200, 3))])
    coef = np.array([1.0, 0.5, 0.0, 2.0])
    assert np.allclose(nnls(x, x @ coef), coef, atol=1e-9)
    y = x @ np.array([1.0, 0.5, -3.0, 2.0])  # a negative truth: clipped, not followed
    assert (nnls(x, y) >= 0).all()


def test_model_learns_the_law_online():
    rng = random.Random(1)
    model = StepCostModel(window=64, refit_every=4)
    assert model.predict(StepShape(100, 8, 1000, 1, 0)) == 0.0
    for _ in range(40):
        s = random_shape(rng)
        model.observe(s, law(s))
    for _ in range(20):
        s = random_shape(rng)
        assert model.predict(s) == pytest.approx(law(s), rel=1e-6)
    assert model.num_observed == 40
    assert model.mean_abs_error_s > 1e-4  # the first guesses (0.0) were wrong
    for _ in range(64):  # a window later, only fitted predictions count
        s = random_shape(rng)
        model.observe(s, law(s))
    assert model.mean_abs_error_s < 1e-9


def test_calibration_outlives_the_window():
    rng = random.Random(2)
    model = StepCostModel(window=32, refit_every=4)
    for _ in range(12):
        s = random_shape(rng)
        model.observe(s, law(s), calibration=True)
    for _ in range(500):  # long decode-only traffic: no prefill in the window
        s = random_shape(rng, decode_only=True)
        model.observe(s, law(s))
    prefill = StepShape(1024, 0, 1024 * 1025 // 2, 0, 0)
    assert model.predict(prefill) == pytest.approx(law(prefill), rel=1e-6)


def test_model_tracks_a_change_in_speed():
    rng = random.Random(3)
    model = StepCostModel(window=64, refit_every=4)
    for _ in range(100):
        s = random_shape(rng)
        model.observe(s, law(s))
    for _ in range(200):  # the device got twice as slow (another tenant of the GPU)
        s = random_shape(rng)
        model.observe(s, 2 * law(s))
    s = StepShape(512, 32, 50_000, 2, 0)
    assert model.predict(s) == pytest.approx(2 * law(s), rel=1e-6)


def test_window_and_refit_are_validated():
    with pytest.raises(ValueError, match="window"):
        StepCostModel(window=0)


def test_no_prediction_falls_below_the_fastest_measured_step():
    # steps whose time the fit cannot tell apart from noise: nnls may price prefill at 0, but
    # a step is never predicted faster than any step measured (a zero would admit a whole
    # prompt under any target)
    model = StepCostModel()
    decode = StepShape(0, 8, 800, 0, 0)
    for seconds in (0.010, 0.030, 0.012, 0.031):
        model.observe(decode, seconds, calibration=True)
    prefill = StepShape(31, 0, 496, 0, 0)
    assert model.predict(prefill) >= 0.010
    assert model.predict(StepShape(0, 0, 0, 0, 0)) >= 0.010
