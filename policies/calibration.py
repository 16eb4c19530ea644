"""Online calibration of the prefill cost model from what the router observes.

Every completed request tells the router its prompt and cached token counts, its time to first token, and the
queue delay the cost model predicted when it was dispatched. ``ttft − queue delay`` is then one noisy sample of
``prefill_ms(uncached tokens)``; a robust straight-line fit over a bounded window of such samples refines the
``fixed_ms`` and ``per_token_ms`` coefficients the policy file started from.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from kvgate.policies.config import CalibrationConfig, PrefillCost

HUBER_K = 1.345
"""Huber's tuning constant: 95% efficiency on Gaussian noise, bounded influence for everything beyond."""
MIN_TOKEN_SPREAD = 64
"""Below this spread of uncached-token counts in the window, the slope is not identifiable: only fixed_ms is fitted."""
MAX_ITERATIONS = 50


@dataclass(frozen=True, slots=True)
class CalibrationState:
    """What the calibrator currently believes, for metrics and ``/kvgate/v1/explain``."""

    samples: int
    """Observations in the window."""
    rejected: int
    """Observations refused as malformed (negative, non-finite, cached > prompt) since start."""
    fitted: bool
    """False until ``min_samples`` observations arrived (the policy file's coefficients apply)."""
    fixed_ms: float
    per_token_ms: float
    clamped: bool
    """The fit wanted a coefficient beyond ``(1 ± max_change)`` × the policy file's value."""


class Calibrator:
    """Fits ``ttft − queue_delay ≈ fixed_ms + per_token_ms · uncached`` by Huber-weighted least squares (IRLS).

    * Robust: residual scale is the MAD, and samples beyond ``1.345 × scale`` get weight ``1.345 × scale / |r|``,
      so one wild TTFT (a GC pause, a preemption) moves the fit by a bounded amount, not in proportion to its size.
    * Bounded: the last ``window`` samples only; nothing is fitted before ``min_samples``; each coefficient stays
      within ``(1 ± max_change)`` × the policy file's value, so a bad stretch of data cannot make the router absurd.
    * No idle drift: the fit is a pure function of the window, recomputed only when a sample arrives.
    * The quadratic term and ``decode_ms_per_token`` are kept from the policy file (the quadratic share is
      subtracted from each sample before fitting).

    Parameters (``calibration``): enabled, window (512), min_samples (32), max_change (0.5).
    """

    def __init__(self, config: CalibrationConfig, base: PrefillCost) -> None:
        self.config = config
        self.base = base
        self._samples: deque[tuple[float, float]] = deque(maxlen=config.window)
        self._rejected = 0
        self._dirty = False
        self._current = base
        self._clamped = False

    def observe(self, prompt_tokens: int, cached_tokens: int, ttft_ms: float, queue_delay_ms_at_dispatch: float) -> bool:
        """Add one completed request; returns False (and counts it) when the numbers cannot be a valid sample."""
        if not self.config.enabled:
            return False
        valid = (
            prompt_tokens > 0
            and 0 <= cached_tokens <= prompt_tokens
            and math.isfinite(ttft_ms)
            and math.isfinite(queue_delay_ms_at_dispatch)
            and ttft_ms > 0
            and queue_delay_ms_at_dispatch >= 0
        )
        if not valid:
            self._rejected += 1
            return False
        uncached = prompt_tokens - cached_tokens
        quadratic = self.base.quadratic_ms * (prompt_tokens**2 - cached_tokens**2) / 1e6
        self._samples.append((float(uncached), ttft_ms - queue_delay_ms_at_dispatch - quadratic))
        self._dirty = True
        return True

    def current(self) -> PrefillCost:
        """The coefficients to use now (the policy file's until ``min_samples`` observations).

        Refits when samples arrived since the last call (a few ms over a full 512-sample window), so call it on a
        timer (e.g. once a second) rather than per request.
        """
        if self._dirty:
            self._dirty = False
            if len(self._samples) >= self.config.min_samples:
                self._refit()
        return self._current

    def state(self) -> CalibrationState:
        current = self.current()
        return CalibrationState(
            samples=len(self._samples),
            rejected=self._rejected,
            fitted=current is not self.base,
            fixed_ms=current.fixed_ms,
            per_token_ms=current.per_token_ms,
            clamped=self._clamped,
        )

    def _refit(self) -> None:
        xs = [x for x, _ in self._samples]
        ys = [y for _, y in self._samples]
        fit_slope = max(xs) - min(xs) >= MIN_TOKEN_SPREAD
        fixed, per_token = _huber_line(xs, ys, self.base.per_token_ms, fit_slope)
        low, high = 1 - self.config.max_change, 1 + self.config.max_change
        clamped_fixed = min(max(fixed, self.base.fixed_ms * low, 0.0), self.base.fixed_ms * high)
        clamped_slope = min(max(per_token, self.base.per_token_ms * low, 0.0), self.base.per_token_ms * high)
        self._clamped = not (math.isclose(clamped_fixed, fixed) and math.isclose(clamped_slope, per_token))
        self._current = self.base.model_copy(update={"fixed_ms": clamped_fixed, "per_token_ms": clamped_slope})


def _huber_line(xs: list[float], ys: list[float], slope: float, fit_slope: bool) -> tuple[float, float]:
    """Huber M-estimate of ``y = a + b·x`` by iteratively reweighted least squares.

    Starts from a robust guess (the given slope, intercept = median residual). With ``fit_slope`` False only the
    intercept is estimated (a Huber location estimate of ``y − slope·x``).
    """
    intercept = statistics.median(y - slope * x for x, y in zip(xs, ys))
    for _ in range(MAX_ITERATIONS):
        residuals = [y - intercept - slope * x for x, y in zip(xs, ys)]
        centre = statistics.median(residuals)
        scale = 1.4826 * statistics.median(abs(r - centre) for r in residuals)
        cutoff = HUBER_K * scale if scale > 0 else 1e-9
        weights = [1.0 if abs(r) <= cutoff else cutoff / abs(r) for r in residuals]
        sw = sum(weights)
        swx = sum(w * x for w, x in zip(weights, xs))
        swy = sum(w * y for w, y in zip(weights, ys))
        new_slope = slope
        if fit_slope:
            swxx = sum(w * x * x for w, x in zip(weights, xs))
            swxy = sum(w * x * y for w, x, y in zip(weights, xs, ys))
            det = sw * swxx - swx * swx
            if det > 0:
                new_slope = (sw * swxy - swx * swy) / det
        new_intercept = (swy - new_slope * swx) / sw
        converged = abs(new_intercept - intercept) < 1e-6 and abs(new_slope - slope) < 1e-9
        intercept, slope = new_intercept, new_slope
        if converged:
            break
    return intercept, slope
