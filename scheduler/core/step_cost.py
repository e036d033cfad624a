"""The step-cost model: how long the model takes for one step, fitted online
from the worker's measured model times (``StepResult.model_seconds``).

    t = a + b * T + c * K
        a   seconds every step pays (weights read once, launch, the host)
        T   tokens computed in the step (prefill chunks + decodes + drafts)
        K   query-key pairs its attention computes (``chunk_keys``): a chunk
            late in a long prompt attends many keys, a decode its context

Two users: the speculation rule (``speculative.py``) reads ``fit()``, the
two-term ``t = a + b * T`` it has always used (keys folded into ``b``);
``--max-step-ms`` (``scheduler.py``) reads ``predict(T, K)``, the three-term
fit, to size prefill chunks so a step with decodes stays under its target.

The three-term fit is a robust least squares over the last ``window`` steps
and the last ``per_size`` steps of each size class (tokens 1, 2-3, 4-7, ...,
in powers of two): under a target the recent steps are all about one size
(decodes and a cut chunk), which leaves the per-token slope to the noise, and
a bigger chunk would then be predicted from it (offline-64 at
``--max-step-ms 100`` on a Zen 5: 470-token chunks with 41-50 decodes
predicted 0.11 s, measured 0.33 s); the big steps seen earlier hold the slope
(replayed on that run's trace: 0.34-0.36 s). Residuals are relative to the
step's time (its noise grows with it). The fit uses
Huber weights (residuals past ``HUBER_K`` robust sigmas count linearly, so a
step slowed by another process does not drag the fit), coefficients kept
non-negative, and a faint ridge pull (``prior_weight``, a millionth of a
step) toward the prior ``(a, b, 0)`` of the two-term fit: it decides only the
directions the window's steps leave open (all steps the same size, keys
growing in step with tokens) and does not bias the rest (half a step of pull
shrank a recovered ``a`` by a third, a thousandth of a step by 0.6%: the
fixed part is the weakest-determined term). Until ``min_steps`` (2) steps are
in, ``ready`` is False and the scheduler does not size steps by it (no
measurement, no cap); from there the prior carries the fit until the steps
differ in size (the first steps of a server fill the budget: a cap must
not wait for them to end).
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

HUBER_K = 1.5           # residuals past this many robust sigmas weigh less
IRLS_ROUNDS = 4         # reweighting rounds of the robust fit
EARLY_STEPS = 16        # below this many steps measured, every step refits


def chunk_keys(start: int, num_tokens: int, window: int = 0) -> int:
    """Query-key pairs of a chunk computing positions [start, start + n):
    position p attends its p + 1 keys (at most ``window`` of them when the
    model's every layer is windowed; 0 = no window)."""
    n = num_tokens
    if not window or start + n <= window:
        return n * start + n * (n + 1) // 2
    # positions below window - 1 attend p + 1 keys, the rest window keys
    head = max(0, window - start)
    return head * start + head * (head + 1) // 2 + (n - head) * window


class StepCostModel:
    """Least-squares step-time models over the last ``window`` steps.

    ``fit()`` (two terms): until the steps' token counts spread (variance <
    ``min_variance``) the slope is the prior ``mean_t / (mean_T +
    prior_tokens)``: a step that would double in time only ``prior_tokens``
    tokens past its size. ``fit_with_keys()`` (three terms): module docstring.
    """

    def __init__(self, window: int = 64, min_variance: float = 4.0, prior_tokens: float = 32.0,
                 min_steps: int = 2, prior_weight: float = 1e-6, refit_every: int = 4,
                 per_size: int = 2) -> None:
        self._steps: deque[tuple[int, int, float]] = deque(maxlen=window)
        self._numbered: deque[tuple[int, int, int, float]] = deque(maxlen=window)  # (n, T, K, t)
        self._by_size: dict[int, deque[tuple[int, int, int, float]]] = {}
        self._per_size = per_size
        self._count = 0
        self.min_variance = min_variance
        self.prior_tokens = prior_tokens
        self.min_steps = min_steps
        self.prior_weight = prior_weight
        self.refit_every = refit_every
        self._since_fit3 = 0       # steps observed since the three-term fit
        self._fit: tuple[float, float] | None = None   # until the next step is observed
        self._fit3: tuple[float, float, float] | None = None

    def observe(self, num_tokens: int, seconds: float, attended_keys: int = 0) -> None:
        """A measured step: its tokens, its model seconds, its query-key pairs."""
        if num_tokens > 0 and attended_keys >= 0 and math.isfinite(seconds) and seconds > 0:
            self._steps.append((num_tokens, attended_keys, seconds))
            step = (self._count, num_tokens, attended_keys, seconds)
            self._count += 1
            self._numbered.append(step)
            self._by_size.setdefault(num_tokens.bit_length(), deque(maxlen=self._per_size)).append(step)
            self._fit = None
            self._since_fit3 += 1

    @property
    def num_observed(self) -> int:
        return len(self._steps)

    @property
    def ready(self) -> bool:
        """Enough steps measured for ``predict`` to size a step."""
        return len(self._steps) >= self.min_steps

    def fit(self) -> tuple[float, float]:
        """(a, b): seconds per step and per token. Before any step is measured,
        a step of 1 s that doubles at ``prior_tokens`` tokens (only the ratio
        of the two matters to the speculation rule, until the engine's
        overhead is known)."""
        if self._fit is None:
            self._fit = self._least_squares()
        return self._fit

    def _least_squares(self) -> tuple[float, float]:
        n = len(self._steps)
        if not n:
            return 1.0, 1.0 / self.prior_tokens
        mean_x = sum(x for x, _, _ in self._steps) / n
        mean_y = sum(y for _, _, y in self._steps) / n
        var = sum((x - mean_x) ** 2 for x, _, _ in self._steps) / n
        if var >= self.min_variance:
            cov = sum((x - mean_x) * (y - mean_y) for x, _, y in self._steps) / n
            b = max(0.0, cov / var)
        else:
            b = mean_y / (mean_x + self.prior_tokens)
        return max(0.0, mean_y - b * mean_x), b

    def seconds(self, num_tokens: int) -> float:
        """The two-term model's time of a step of ``num_tokens`` tokens."""
        a, b = self.fit()
        return a + b * num_tokens

    def fit_with_keys(self) -> tuple[float, float, float]:
        """(a, b, c): seconds per step, per token and per attended key. Fitted
        again once ``refit_every`` steps came in (at every step while the
        window holds fewer than ``EARLY_STEPS``: the first steps move it most):
        a fit costs ~0.2 ms, a step's prediction must not."""
        stale = self._since_fit3 >= (1 if len(self._steps) < EARLY_STEPS else self.refit_every)
        if self._fit3 is None or stale:
            a, b = self.fit()
            self._fit3 = (a, b, 0.0) if not self._steps else self._robust_fit((a, b, 0.0))
            self._since_fit3 = 0
        return self._fit3

    def predict(self, num_tokens: int, attended_keys: int) -> float:
        """The three-term model's time of a step."""
        a, b, c = self.fit_with_keys()
        return a + b * num_tokens + c * attended_keys

    def _robust_fit(self, prior: tuple[float, float, float]) -> tuple[float, float, float]:
        kept = {step[0]: step for size in self._by_size.values() for step in size}
        kept.update((step[0], step) for step in self._numbered)
        data = np.array([step[1:] for step in kept.values()], dtype=np.float64)   # (n, 3): T, K, t
        x = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
        y = data[:, 2]
        # Relative residuals: a step's noise grows with its time, so a long step's
        # few-ms miss is no outlier beside short steps' sub-ms ones.
        x, y = x / y[:, None], np.ones(len(y))
        # Columns scaled to their mean size, so the ridge weighs each term's
        # contribution at a typical step, and the normal equations stay conditioned.
        scale = np.abs(x).mean(axis=0)
        scale[scale == 0] = 1.0
        z, z0 = x / scale, np.asarray(prior) * scale
        weights = np.ones(len(y))
        coef = z0
        for _ in range(IRLS_ROUNDS):
            coef = _nonnegative_ridge(z, y, weights, z0, self.prior_weight)
            residual = np.abs(y - z @ coef)
            sigma = 1.4826 * float(np.median(residual))
            if sigma <= 1e-12:
                break
            weights = np.minimum(1.0, HUBER_K * sigma / np.maximum(residual, 1e-300))
        a, b, c = (coef / scale).tolist()
        return a, b, c


def _nonnegative_ridge(z: np.ndarray, y: np.ndarray, w: np.ndarray, z0: np.ndarray, lam: float) -> np.ndarray:
    """argmin sum w (y - z @ coef)^2 + lam |coef - z0|^2 with coef >= 0: a
    negative coefficient is fixed at 0 and the others solved again."""
    free = np.ones(z.shape[1], dtype=bool)
    coef = np.zeros(z.shape[1])
    while free.any():
        zf = z[:, free]
        gram = (zf * w[:, None]).T @ zf + lam * np.eye(int(free.sum()))
        rhs = (zf * w[:, None]).T @ y + lam * z0[free]
        solved = np.linalg.solve(gram, rhs)
        if (solved >= 0).all():
            coef[free] = solved
            return coef
        index = np.flatnonzero(free)[int(np.argmin(solved))]
        free[index] = False
    return coef
