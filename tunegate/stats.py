"""Anytime-valid confidence bounds for rates: the one bound the tuner's gate and the canary's judge both use.

A canary's judge looks at its evidence once a second, and a fixed-sample bound checked that often is
wrong far more often than its confidence says (peeking). These bounds are *confidence sequences*: the
chance that the true rate ever leaves them, at any look, however many looks, is at most 1 - confidence.

Each one-sided bound inverts a test martingale, a mixture of likelihood ratios over a fixed grid of
alternatives (Robbins' method of mixtures; Ville's inequality makes the mixture exceed 1/alpha with
probability at most alpha under the null, at any stopping time):

- upper bound U: the smallest p0 for which "rate >= p0" is rejected, with alternatives p0*r, r in [0, 1).
  The alternative r = 0 (no failures at all) carries a large weight, so a clean run is shown below a
  budget b after about ln(1/(w0*alpha))/b samples: 1,036 for b = 0.5% at 99% (a fixed-horizon bound
  needs 919, and is only valid when looked at once).
- lower bound L: the largest p0 for which "rate <= p0" is rejected, alternatives p0 + (1-p0)*s, s in (0, 1).

Counts may be fractional: dividing both by a design effect (clustered failures) widens the bounds as
if fewer independent samples had been seen.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

# Alternatives for the upper bound, as fractions of p0: 0 (a clean candidate) and a grid up to p0.
_R = np.array([0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.93, 0.95, 0.97, 0.98, 0.99])
_LOG_R = np.concatenate([[-np.inf], np.log(_R[1:])])
_LOG_W_R = np.log(np.concatenate([[0.5], np.full(_R.size - 1, 0.5 / (_R.size - 1))]))
# Alternatives for the lower bound: p0 + (1 - p0) * s, from just above p0 to near certainty.
_S = np.geomspace(1e-4, 0.9, 24)
_LOG_W_S = np.full(_S.size, -math.log(_S.size))
_GRID = 64
_PASSES = 2  # relative precision about 2e-4 of the bound
_TINY = 1e-12
_UNIT = np.linspace(0.0, 1.0, _GRID)


def _log_mixture_upper(k: float, n: float, p0: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """log of the mixture martingale against H0: rate >= p0, for each p0."""
    p1 = p0[:, None] * _R[None, :]
    log_lr = (n - k) * (np.log1p(-p1) - np.log1p(-p0)[:, None])
    if k > 0:
        log_lr = log_lr + k * _LOG_R[None, :]
    return _logsumexp(log_lr, _LOG_W_R)


def _log_mixture_lower(k: float, n: float, p0: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """log of the mixture martingale against H0: rate <= p0, for each p0."""
    p1 = p0[:, None] + (1.0 - p0[:, None]) * _S[None, :]
    log_lr = k * (np.log(p1) - np.log(p0)[:, None]) + (n - k) * np.log1p(-_S)[None, :]
    return _logsumexp(log_lr, _LOG_W_S)


def _logsumexp(log_lr: npt.NDArray[np.float64], log_w: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    a = log_lr + log_w[None, :]
    top = np.max(a, axis=1)
    safe = np.where(np.isfinite(top), top, 0.0)
    return np.asarray(safe + np.log(np.exp(a - safe[:, None]).sum(axis=1)))


def _alpha(confidence: float) -> float:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be within (0, 1), got {confidence}")
    return 1.0 - confidence


def _crossing(
    fn: Callable[[npt.NDArray[np.float64]], npt.NDArray[np.float64]],
    lo: float,
    hi: float,
    threshold: float,
    rising: bool,
) -> float:
    """Where a monotone fn crosses `threshold` in [lo, hi]: the first p0 at or above it (rising), else the last.

    Three passes over a grid of _GRID points, each within the bracket the last one found (log-spaced first,
    since rates span many orders of magnitude): one numpy evaluation per pass instead of a bisection's dozens.
    """
    grid = lo * np.exp(math.log(hi / lo) * _UNIT)
    for step in range(_PASSES):
        over = fn(grid) >= threshold
        if rising:
            i = int(np.argmax(over)) if over.any() else _GRID
            if i == _GRID:
                return float(hi)
            if i == 0 or step == _PASSES - 1:
                return float(grid[i])
            grid = grid[i - 1] + (grid[i] - grid[i - 1]) * _UNIT
        else:
            i = _GRID - 1 - int(np.argmax(over[::-1])) if over.any() else -1
            if i < 0:
                return float(lo)
            if i == _GRID - 1 or step == _PASSES - 1:
                return float(grid[i])
            grid = grid[i] + (grid[i + 1] - grid[i]) * _UNIT
    raise AssertionError("unreachable")


@functools.lru_cache(maxsize=1 << 16)  # the judge asks again each look with counts that moved little
def rate_upper(k: float, n: float, confidence: float) -> float:
    """Anytime-valid one-sided upper bound of a rate after k events in n trials."""
    threshold = math.log(1.0 / _alpha(confidence))
    if n <= 0 or k >= n:
        return 1.0
    # The martingale grows with p0 and is at most 1 at p0 = k/n: the bound lies above the estimate.
    return _crossing(lambda p0: _log_mixture_upper(k, n, p0), max(k / n, _TINY), 1.0 - 1e-12, threshold, True)


@functools.lru_cache(maxsize=1 << 16)
def rate_lower(k: float, n: float, confidence: float) -> float:
    """Anytime-valid one-sided lower bound of a rate after k events in n trials."""
    threshold = math.log(1.0 / _alpha(confidence))
    if n <= 0 or k <= 0:
        return 0.0
    found = _crossing(lambda p0: _log_mixture_lower(k, n, p0), _TINY, k / n, threshold, False)
    return 0.0 if found <= _TINY else found


def rate_bounds(k: float, n: float, confidence: float) -> tuple[float, float]:
    """(lower, upper): each an anytime-valid one-sided bound at `confidence`."""
    return rate_lower(k, n, confidence), rate_upper(k, n, confidence)


def samples_to_show_below(budget: float, confidence: float) -> int:
    """The fewest clean samples (no event) whose upper bound is at most `budget`."""
    if not 0.0 < budget < 1.0:
        raise ValueError(f"budget must be within (0, 1), got {budget}")
    lo, hi = 1, 1
    while rate_upper(0, hi, confidence) > budget:
        lo, hi = hi, hi * 2
    while lo < hi:
        mid = (lo + hi) // 2
        if rate_upper(0, mid, confidence) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return hi


# Bets for the paired difference: fractions of the largest bet that keeps every factor non-negative.
_BETS = np.array([0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.65, 0.8, 0.9, 0.97])
_LOG_W_BETS = np.full(_BETS.size, -math.log(_BETS.size))


def _log_wealth_upper(
    plus: float, minus: float, n: float, d0: npt.NDArray[np.float64]
) -> npt.NDArray[np.float64]:
    """log of the mixture of bets against H0: mean >= d0, for x in {-1, 0, 1} counted as (plus, minus, n)."""
    lam = _BETS[None, :] / (1.0 - d0[:, None])  # the largest bet keeps 1 - lam * (1 - d0) >= 0
    zero = n - plus - minus
    log_k = (plus * np.log1p(np.maximum(-lam * (1.0 - d0[:, None]), -1.0 + 1e-15))
             + minus * np.log1p(lam * (1.0 + d0[:, None])) + zero * np.log1p(lam * d0[:, None]))  # fmt: skip
    return _logsumexp(log_k, _LOG_W_BETS)


@functools.lru_cache(maxsize=1 << 16)
def difference_upper(plus: float, minus: float, n: float, confidence: float) -> float:
    """Anytime-valid upper bound of P(x = 1) - P(x = -1) after `plus` ones and `minus` minus-ones in n trials.

    For paired trials (one request sent to both versions) x is +1 when only the candidate failed, -1 when only
    the baseline did: the bound is on rate(candidate) - rate(baseline), and the failures both share cancel.
    A betting confidence sequence (Waudby-Smith and Ramdas): wealth prod(1 + lam (d0 - x)) over a fixed mixture
    of bets lam; a clean run of n trials shows the difference below d0 after about ln(10/alpha)/d0 trials.
    """
    threshold = math.log(1.0 / _alpha(confidence))
    if n <= 0:
        return 1.0
    est = max((plus - minus) / n, -1.0 + 1e-9)
    if est >= 1.0 - 1e-9:
        return 1.0
    # The wealth grows with d0 and is at most 1 at the estimate: search the distance above it, log-spaced
    # (the bound is typically a fraction of a per cent above the estimate).
    found = _crossing(
        lambda x: _log_wealth_upper(plus, minus, n, est + x), 1e-9, 1.0 - 1e-9 - est, threshold, True
    )
    return min(1.0, est + found)


def difference_lower(plus: float, minus: float, n: float, confidence: float) -> float:
    """Anytime-valid lower bound of P(x = 1) - P(x = -1): the upper bound with the roles swapped."""
    return -difference_upper(minus, plus, n, confidence)
