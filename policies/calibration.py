"""Online calibration of the prefill cost model from what the router observes.

Every completed request tells the router its prompt and cached token counts, its time to first token from its dispatch
(the gateway's own queue is not the engine's), and the work the cost model counted ahead of it when it was dispatched
(its queue delay before ``queue_scale``). ``ttft`` is then one noisy sample of ``queue_scale · work ahead +
prefill_ms(uncached tokens)``; a robust linear fit over a bounded window of such samples refines ``fixed_ms``,
``per_token_ms`` and ``queue_scale`` from the policy file's values. A queue term that predicts nothing (an engine that
batches what the model counts as queued) fits a scale near 0, and the policy stops leaning on it. An answer read whole
shows no first token, only a bound on it (its whole time), which counts where the fit predicts more than that
(:meth:`Calibrator.observe_bound`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from kvgate.policies.config import CalibrationConfig, PrefillCost

HUBER_K = 1.345
"""Huber's tuning constant: 95% efficiency on Gaussian noise, bounded influence for everything beyond."""
MIN_TOKEN_SPREAD = 64
"""Below this spread of uncached-token counts in the window, the slope is not identifiable: it is kept."""
MIN_QUEUE_SPREAD_MS = 10.0
"""Below this spread of the work counted ahead (ms), the queue scale is not identifiable: it is kept."""
MAX_ITERATIONS = 50
MAX_CONDITION = 1e12
"""Normal equations worse conditioned than this are treated as singular: the fit stops where it is."""


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
    queue_scale: float
    clamped: bool
    """The fit wanted a coefficient beyond its bounds (``(1 ± max_change)`` × the policy file's value; the queue
    scale from 0)."""


class Calibrator:
    """Fits ``ttft ≈ fixed_ms + per_token_ms · uncached + queue_scale · work_ahead`` by Huber-weighted least
    squares (IRLS).

    * Robust: residual scale is the MAD, and samples beyond ``1.345 × scale`` get weight ``1.345 × scale / |r|``,
      so one wild TTFT (a GC pause, a preemption) moves the fit by a bounded amount, not in proportion to its size.
    * Bounded: the last ``window`` samples only; nothing is fitted before ``min_samples``; ``fixed_ms`` and
      ``per_token_ms`` stay within ``(1 ± max_change)`` × the policy file's values and ``queue_scale`` between 0
      and ``(1 + max_change)`` × the file's, so a bad stretch of data cannot make the router absurd.
    * Identifiable only: the slope is fitted when the uncached counts spread by ``MIN_TOKEN_SPREAD`` tokens, the
      queue scale when the work ahead spreads by ``MIN_QUEUE_SPREAD_MS``; otherwise each keeps the file's value.
    * No idle drift: the fit is a pure function of the window, recomputed only when a sample arrives.
    * The quadratic term and ``decode_ms_per_token`` are kept from the policy file (the quadratic share is
      subtracted from each sample before fitting).

    Parameters (``calibration``): enabled, window (512), min_samples (32), max_change (0.5).
    """

    def __init__(self, config: CalibrationConfig, base: PrefillCost) -> None:
        self.config = config
        self.base = base
        self._samples: deque[tuple[float, float, float]] = deque(maxlen=config.window)
        self._rejected = 0
        self._dirty = False
        self._current = base
        self._clamped = False

    def observe(self, prompt_tokens: int, cached_tokens: int, ttft_ms: float, work_ahead_ms: float) -> bool:
        """Add one completed request's first token (``ttft_ms`` from its dispatch; ``work_ahead_ms``: the cost
        model's queue delay at dispatch, before ``queue_scale``); returns False (and counts it) when the numbers
        cannot be a valid sample."""
        sample = self._sample(prompt_tokens, cached_tokens, ttft_ms, work_ahead_ms)
        if sample is None:
            return False
        self._samples.append(sample)
        self._dirty = True
        return True

    def observe_bound(self, prompt_tokens: int, cached_tokens: int, bound_ms: float, work_ahead_ms: float) -> bool:
        """Add a completed request whose first token was not seen but came within ``bound_ms`` of its dispatch (an
        answer read whole: its whole time). It is kept only when the current fit predicts more than the bound: the
        prediction is then certainly too high, and the bound lies between it and the truth, so the fit moves toward
        the truth. Otherwise it says nothing about the fit. Without this, traffic read whole would leave the policy
        file's coefficients in force however fast the engine is, and admission would hold requests for a queue that
        does not exist. Returns whether it was kept."""
        sample = self._sample(prompt_tokens, cached_tokens, bound_ms, work_ahead_ms)
        if sample is None:
            return False
        uncached, ahead, bound = sample
        current = self._current
        if bound >= current.fixed_ms + current.per_token_ms * uncached + current.queue_scale * ahead:
            return False
        self._samples.append(sample)
        self._dirty = True
        return True

    def _sample(self, prompt_tokens: int, cached_tokens: int, ttft_ms: float,
                work_ahead_ms: float) -> tuple[float, float, float] | None:
        """``(uncached tokens, work ahead, ttft less the quadratic term)``, or None (counted as rejected) for numbers
        that cannot be a sample."""
        if not self.config.enabled:
            return None
        valid = (
            prompt_tokens > 0
            and 0 <= cached_tokens <= prompt_tokens
            and math.isfinite(ttft_ms)
            and math.isfinite(work_ahead_ms)
            and ttft_ms > 0
            and work_ahead_ms >= 0
        )
        if not valid:
            self._rejected += 1
            return None
        uncached = prompt_tokens - cached_tokens
        quadratic = self.base.quadratic_ms * (prompt_tokens**2 - cached_tokens**2) / 1e6
        return float(uncached), work_ahead_ms, ttft_ms - quadratic

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
            queue_scale=current.queue_scale,
            clamped=self._clamped,
        )

    def _refit(self) -> None:
        base = self.base
        samples = np.array(self._samples, dtype=float)
        tokens, ahead, ttfts = samples[:, 0], samples[:, 1], samples[:, 2]
        free = (True, np.ptp(tokens) >= MIN_TOKEN_SPREAD, np.ptp(ahead) >= MIN_QUEUE_SPREAD_MS)
        fixed, per_token, scale = _huber_fit(samples[:, :2], ttfts, (base.per_token_ms, base.queue_scale), free)
        low, high = 1 - self.config.max_change, 1 + self.config.max_change
        clamped_fixed = min(max(fixed, base.fixed_ms * low, 0.0), base.fixed_ms * high)
        clamped_slope = min(max(per_token, base.per_token_ms * low, 0.0), base.per_token_ms * high)
        clamped_scale = min(max(scale, 0.0), base.queue_scale * high)
        self._clamped = not (math.isclose(clamped_fixed, fixed) and math.isclose(clamped_slope, per_token)
                             and math.isclose(clamped_scale, scale))
        self._current = base.model_copy(
            update={"fixed_ms": clamped_fixed, "per_token_ms": clamped_slope, "queue_scale": clamped_scale})


def _huber_fit(
    columns: np.ndarray, ys: np.ndarray, start: tuple[float, ...], free: tuple[bool, ...],
) -> tuple[float, ...]:
    """Huber M-estimate of ``y = a + Σ bⱼ·xⱼ`` (``columns``' columns are the xⱼ) by iteratively reweighted least
    squares.

    Only the coefficients marked ``free`` (the intercept first, then one per column) are estimated; the others keep
    their ``start`` values. In two passes: the intercept and the first slope from a robust guess (the start slopes,
    intercept = median residual), the residual scale re-estimated (MAD) each iteration; then, when further slopes
    are free, all of them from that fit with its scale held. Held, the scale cannot grow towards a cluster of late
    samples that a free slope would otherwise chase (a queue scale turned negative to fit stalls at an empty queue).
    """
    rows = np.column_stack((np.ones(len(ys)), columns))
    slopes = np.array(start, dtype=float)
    coef = np.concatenate(([_median(ys - columns @ slopes)], slopes))
    coef, scale = _irls(rows, ys, coef, [j for j in range(2) if free[j]], None)
    if any(free[2:]):
        coef, _ = _irls(rows, ys, coef, [j for j, f in enumerate(free) if f], scale)
    return tuple(float(c) for c in coef)


def _irls(
    rows: np.ndarray, ys: np.ndarray, coef: np.ndarray, fitted: list[int], held_scale: float | None,
) -> tuple[np.ndarray, float]:
    """Huber IRLS of the ``fitted`` coefficients from ``coef``; the fit and the last residual scale."""
    scale = 0.0
    held = [j for j in range(len(coef)) if j not in fitted]
    x = rows[:, fitted]
    for _ in range(MAX_ITERATIONS):
        residuals = ys - rows @ coef
        if held_scale is None:
            scale = 1.4826 * _median(np.abs(residuals - _median(residuals)))
        else:
            scale = held_scale
        cutoff = HUBER_K * scale if scale > 0 else 1e-9
        size = np.abs(residuals)
        weights = np.where(size <= cutoff, 1.0, cutoff / np.maximum(size, 1e-300))
        # Weighted normal equations for the fitted coefficients, the others' share taken off each y.
        targets = ys - rows[:, held] @ coef[held]
        weighted = x * weights[:, None]
        matrix = weighted.T @ x
        if not np.isfinite(matrix).all():
            break
        eigenvalues = np.linalg.eigvalsh(matrix)  # ascending: the matrix is symmetric positive semi-definite
        if eigenvalues[0] <= 0 or eigenvalues[-1] > MAX_CONDITION * eigenvalues[0]:
            break  # singular: the data cannot tell these coefficients apart
        solved = np.linalg.solve(matrix, weighted.T @ targets)
        new = coef.copy()
        new[fitted] = solved
        converged = bool(np.all(np.abs(new - coef) < 1e-9 * np.maximum(1.0, np.abs(new))))
        coef = new
        if converged:
            break
    return coef, scale


def _median(values: np.ndarray) -> float:
    """The median of a 1-D array of finite values, as ``np.median`` computes it, by one partial sort: without
    ``np.median``'s general machinery (axes, NaN checks), which is most of its cost on a window's few hundred values
    and which the IRLS loop would pay twice an iteration."""
    n = len(values)
    half = n // 2
    if n % 2:
        return float(np.partition(values, half)[half])
    ordered = np.partition(values, (half - 1, half))
    return 0.5 * (float(ordered[half - 1]) + float(ordered[half]))
