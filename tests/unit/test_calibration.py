"""Online calibration: converges on synthetic observations, resists outliers, stays put when idle or unsure."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from kvgate.policies.calibration import Calibrator, _median
from kvgate.policies.config import CalibrationConfig, PrefillCost

BASE = PrefillCost(fixed_ms=20, per_token_ms=0.035)
TRUE_FIXED, TRUE_PER_TOKEN = 26.0, 0.042


def feed(cal: Calibrator, n: int, rng: random.Random, noise_ms: float = 3.0) -> None:
    for _ in range(n):
        prompt = rng.randint(200, 8000)
        cached = rng.choice([0, prompt // 2, prompt - 16])
        queue = rng.uniform(0, 300)
        ttft = queue + TRUE_FIXED + TRUE_PER_TOKEN * (prompt - cached) + rng.gauss(0, noise_ms)
        cal.observe(prompt, cached, ttft, queue)


def test_uses_the_policy_file_until_min_samples() -> None:
    cal = Calibrator(CalibrationConfig(min_samples=32), BASE)
    feed(cal, 31, random.Random(0))
    assert cal.current() == BASE and not cal.state().fitted
    feed(cal, 1, random.Random(1))
    assert cal.current() != BASE and cal.state().fitted


def test_converges_on_synthetic_observations() -> None:
    cal = Calibrator(CalibrationConfig(), BASE)
    feed(cal, 400, random.Random(2))
    fitted = cal.current()
    assert fitted.fixed_ms == pytest.approx(TRUE_FIXED, abs=1.0)
    assert fitted.per_token_ms == pytest.approx(TRUE_PER_TOKEN, rel=0.02)
    assert fitted.quadratic_ms == BASE.quadratic_ms
    assert not cal.state().clamped


def test_resists_one_huge_outlier_and_a_fifth_of_bad_samples() -> None:
    rng = random.Random(3)
    cal = Calibrator(CalibrationConfig(), BASE)
    feed(cal, 200, rng)
    cal.observe(1000, 0, 60_000.0, 0.0)  # a one-minute stall
    fitted = cal.current()
    assert fitted.fixed_ms == pytest.approx(TRUE_FIXED, abs=1.5)
    assert fitted.per_token_ms == pytest.approx(TRUE_PER_TOKEN, rel=0.03)
    for _ in range(50):  # 20% of samples 2-5 s late (preemptions)
        prompt = rng.randint(200, 8000)
        cal.observe(prompt, 0, TRUE_FIXED + TRUE_PER_TOKEN * prompt + rng.uniform(2000, 5000), 0.0)
    fitted = cal.current()
    assert fitted.fixed_ms == pytest.approx(TRUE_FIXED, abs=5)
    assert fitted.per_token_ms == pytest.approx(TRUE_PER_TOKEN, rel=0.15)


def test_no_drift_when_idle() -> None:
    cal = Calibrator(CalibrationConfig(), BASE)
    feed(cal, 100, random.Random(4))
    first = cal.current()
    for _ in range(10):
        assert cal.current() is first


def test_coefficients_are_clamped_to_max_change() -> None:
    cal = Calibrator(CalibrationConfig(max_change=0.5), BASE)
    for i in range(100):
        prompt = 500 + 50 * i
        cal.observe(prompt, 0, 100 + 0.2 * prompt, 0.0)  # 5x fixed, 6x per-token
    fitted = cal.current()
    assert (fitted.fixed_ms, fitted.per_token_ms) == (pytest.approx(30), pytest.approx(0.0525))
    assert cal.state().clamped


def test_without_token_spread_only_fixed_is_fitted() -> None:
    cal = Calibrator(CalibrationConfig(), BASE)
    for _ in range(40):
        cal.observe(4016, 4000, 25 + 0.035 * 16, 0.0)  # every request a full-prefix hit
    fitted = cal.current()
    assert fitted.per_token_ms == BASE.per_token_ms
    assert fitted.fixed_ms == pytest.approx(25)


def test_malformed_observations_are_counted_not_fitted() -> None:
    cal = Calibrator(CalibrationConfig(), BASE)
    for args in ((0, 0, 10.0, 0.0), (100, 200, 10.0, 0.0), (100, 0, math.nan, 0.0), (100, 0, 10.0, -1.0), (100, 0, math.inf, 0.0)):
        assert cal.observe(*args) is False
    assert cal.state().rejected == 5 and cal.state().samples == 0


def test_disabled_calibration_keeps_the_policy_file() -> None:
    cal = Calibrator(CalibrationConfig(enabled=False), BASE)
    feed(cal, 100, random.Random(5))
    assert cal.current() is BASE and cal.state().samples == 0


def test_window_is_bounded() -> None:
    cal = Calibrator(CalibrationConfig(window=64, min_samples=16), BASE)
    feed(cal, 500, random.Random(6))
    assert cal.state().samples == 64


@pytest.mark.parametrize("true_scale", [0.0, 0.3, 1.0])
def test_the_queue_scale_is_fitted_to_how_much_of_the_work_ahead_a_request_waits_for(true_scale: float) -> None:
    rng = random.Random(11)
    cal = Calibrator(CalibrationConfig(), BASE)
    for _ in range(400):
        prompt = rng.randint(200, 8000)
        ahead = rng.uniform(0, 400)
        cal.observe(prompt, 0, TRUE_FIXED + TRUE_PER_TOKEN * prompt + true_scale * ahead + rng.gauss(0, 3), ahead)
    fitted = cal.current()
    assert fitted.queue_scale == pytest.approx(true_scale, abs=0.03)
    assert fitted.fixed_ms == pytest.approx(TRUE_FIXED, abs=1.5)
    assert fitted.per_token_ms == pytest.approx(TRUE_PER_TOKEN, rel=0.03)


def test_the_queue_scale_stays_between_zero_and_max_change_and_is_kept_without_spread() -> None:
    rng = random.Random(12)
    over = Calibrator(CalibrationConfig(max_change=0.5), BASE)
    flat = Calibrator(CalibrationConfig(), BASE)
    for _ in range(200):
        prompt = rng.randint(200, 8000)
        ahead = rng.uniform(0, 400)
        ttft = TRUE_FIXED + TRUE_PER_TOKEN * prompt
        over.observe(prompt, 0, ttft + 3.0 * ahead, ahead)
        flat.observe(prompt, 0, ttft + 0.2 * 5.0, 5.0)  # the same work ahead every time: the scale cannot be told
    assert over.current().queue_scale == pytest.approx(1.5) and over.state().clamped
    assert flat.current().queue_scale == BASE.queue_scale


def test_answers_read_whole_bring_an_overpredicted_queue_down_and_never_below_their_first_tokens() -> None:
    """Against an engine that never queues, the file's queue scale predicts hundreds of ms for work ahead that costs
    nothing. Answers read whole (their whole time a bound on the first token, here first token + 80 ms of decode) must
    bring the prediction down to what they bound, and no further: a bound says "at most", never "this much"."""
    rng = random.Random(13)
    cal = Calibrator(CalibrationConfig(), BASE)
    decode_ms = 80.0
    for _ in range(600):
        prompt = rng.randint(200, 8000)
        ahead = rng.uniform(0, 400)
        first_token = TRUE_FIXED + TRUE_PER_TOKEN * prompt
        cal.observe_bound(prompt, 0, first_token + decode_ms + rng.gauss(0, 3), ahead)
        cal.current()  # the gateway refits on a timer; here after every answer
    fitted = cal.current()
    assert fitted.queue_scale < 0.1  # from 1.0: the work ahead costs this engine nothing
    for prompt, ahead in ((500, 0.0), (4000, 200.0), (8000, 400.0)):
        predicted = fitted.fixed_ms + fitted.per_token_ms * prompt + fitted.queue_scale * ahead
        assert predicted >= TRUE_FIXED + TRUE_PER_TOKEN * prompt - 10.0  # not below the truth (beyond noise)


def test_a_bound_above_the_prediction_is_not_a_sample() -> None:
    cal = Calibrator(CalibrationConfig(), BASE)
    predicted = BASE.fixed_ms + BASE.per_token_ms * 1000 + BASE.queue_scale * 50.0
    assert not cal.observe_bound(1000, 0, predicted + 1.0, 50.0)
    assert cal.observe_bound(1000, 0, predicted - 1.0, 50.0)
    assert not cal.observe_bound(1000, 2000, 1.0, 50.0)  # malformed: counted as rejected
    assert cal.state().samples == 1 and cal.state().rejected == 1


def test_coefficients_the_data_cannot_tell_apart_keep_a_finite_fit() -> None:
    """The work ahead always a fixed multiple of the uncached tokens: both spread, so both are free, but the normal
    equations are singular. The fit stops where its first pass left it instead of solving them."""
    rng = random.Random(9)
    cal = Calibrator(CalibrationConfig(), BASE)
    for _ in range(200):
        prompt = rng.randint(200, 8000)
        cal.observe(prompt, 0, TRUE_FIXED + 0.1 * prompt + rng.gauss(0, 3.0), 2.0 * prompt)
    fitted = cal.current()
    assert all(math.isfinite(v) for v in (fitted.fixed_ms, fitted.per_token_ms, fitted.queue_scale))
    assert fitted.queue_scale == BASE.queue_scale


@pytest.mark.parametrize("n", [1, 2, 3, 4, 511, 512])
def test_the_windows_median_is_numpys(n: int) -> None:
    values = np.random.default_rng(n).normal(size=n)
    assert _median(values) == float(np.median(values))
