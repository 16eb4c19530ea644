import math

import pytest

from kvgate.policies.rate import DecayedRate


def test_steady_stream_reads_its_rate() -> None:
    rate = DecayedRate(half_life_s=5.0)
    for i in range(2000):  # 4 events/s for 500 s: long past the warm-up
        rate.add(i * 0.25)
    assert rate.per_s(500.0) == pytest.approx(4.0, rel=0.05)


def test_stopped_stream_halves_every_half_life() -> None:
    rate = DecayedRate(half_life_s=2.0)
    rate.add(0.0, count=10)
    start = rate.per_s(0.0)
    assert start == pytest.approx(10 * math.log(2) / 2.0)
    assert rate.per_s(2.0) == pytest.approx(start / 2)
    assert rate.per_s(6.0) == pytest.approx(start / 8)


def test_clock_going_backwards_is_no_time_passing() -> None:
    rate = DecayedRate(half_life_s=1.0)
    rate.add(10.0)
    before = rate.per_s(10.0)
    assert rate.per_s(9.0) == before
    rate.add(9.5)
    assert rate.per_s(10.0) == pytest.approx(2 * before)


def test_empty_rate_is_zero_and_half_life_must_be_positive() -> None:
    assert DecayedRate(1.0).per_s(123.0) == 0.0
    with pytest.raises(ValueError):
        DecayedRate(0.0)


def test_unbiased_rate_reads_a_steady_stream_from_the_start() -> None:
    plain, unbiased = DecayedRate(half_life_s=10.0), DecayedRate(half_life_s=10.0, unbiased=True)
    unbiased.per_s(0.0)  # asked before the first event: observation starts here
    for i in range(1, 21):  # 4 events/s for 5 s: half a half-life
        plain.add(i * 0.25)
        unbiased.add(i * 0.25)
    assert plain.per_s(5.0) < 0.75 * 4.0
    assert unbiased.per_s(5.0) == pytest.approx(4.0, rel=0.1)


def test_unbiased_rate_of_one_first_event_is_bounded() -> None:
    rate = DecayedRate(half_life_s=10.0, unbiased=True)
    rate.add(0.0)
    # At most one event per MIN_OBSERVED_FRACTION of a half-life, however soon it is asked.
    assert rate.per_s(0.0) == pytest.approx(1 / (10.0 * DecayedRate.MIN_OBSERVED_FRACTION), rel=0.05)
    assert DecayedRate(10.0, unbiased=True).per_s(5.0) == 0.0


def test_unbiased_rate_converges_to_the_plain_one() -> None:
    plain, unbiased = DecayedRate(half_life_s=1.0), DecayedRate(half_life_s=1.0, unbiased=True)
    for t in (0.0, 0.5, 1.0):
        plain.add(t)
        unbiased.add(t)
    assert unbiased.per_s(100.0) == pytest.approx(plain.per_s(100.0))
