"""How long an engine step takes, predicted from its shape: the cost model behind
``target_itl_ms`` (stall-free scheduling).

A step's time is modelled as linear in a few counts the scheduler knows before the step runs
(``StepShape``)::

    t = c0 + c1 * prefill tokens + c2 * decode tokens + c3 * attention context tokens
           + c4 * distinct adapters + c5 * adapter pages copied in

with every ``c_i >= 0``, so that the prediction grows with every count (the scheduler relies
on that to size a prefill chunk by bisection). ``StepCostModel`` fits the coefficients online
by non-negative least squares over the calibration steps (dummy steps run at start, kept for
good: they cover shapes that live traffic may not) and a window of the latest measured steps,
refitted every few steps. The same model serves a GPU (where decode rows are cheap and
attention over long contexts is not) and the CPU path; nothing in it knows the device.

The scheduler never sees a clock: it gets ``StepCostModel.predict`` as a function of a
``StepShape``, and its tests pass a synthetic one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

FEATURES = ("intercept", "prefill_tokens", "decode_tokens", "context_tokens", "adapters",
            "adapter_pages_loaded")


def context_tokens(num_computed_tokens: int, num_new_tokens: int) -> int:
    """Keys attended by ``num_new_tokens`` query tokens that follow ``num_computed_tokens``
    cached ones, summed over the queries (causal): a decode row attends its whole context; a
    prefill chunk of ``n`` after ``c`` tokens attends ``n * c + n * (n + 1) / 2`` keys."""
    n = num_new_tokens
    return n * num_computed_tokens + n * (n + 1) // 2


@dataclass(frozen=True)
class StepShape:
    """The counts a step's time is predicted from (all known before it runs).

    Attributes:
        num_prefill_tokens: prompt tokens computed this step (cached prefix pages excluded:
            they cost nothing to prefill).
        num_decode_tokens: tokens of rows whose prompt is already in the KV cache (one per
            decoding request; more for verification rows or n > 1).
        num_context_tokens: keys attended, summed over every query token (``context_tokens``).
        num_adapters: distinct adapters among the step's rows.
        num_adapter_pages_loaded: adapter pages copied into the pool for this step's
            admissions.
    """

    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_context_tokens: int = 0
    num_adapters: int = 0
    num_adapter_pages_loaded: int = 0

    def features(self) -> tuple[float, ...]:
        """The regression row, in ``FEATURES`` order."""
        return (1.0, float(self.num_prefill_tokens), float(self.num_decode_tokens),
                float(self.num_context_tokens), float(self.num_adapters),
                float(self.num_adapter_pages_loaded))

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


@dataclass
class StepShapeBuilder:
    """A step's shape built row by row; ``with_row`` prices a row without adding it."""

    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_context_tokens: int = 0
    num_adapter_pages_loaded: int = 0
    adapter_rows: dict[str, int] = field(default_factory=dict)  # digest -> rows using it

    def _apply(self, sign: int, num_computed: int, n: int, decode: bool, digest: str | None,
               pages_loaded: int) -> None:
        if decode:
            self.num_decode_tokens += sign * n
        else:
            self.num_prefill_tokens += sign * n
        self.num_context_tokens += sign * context_tokens(num_computed, n)
        self.num_adapter_pages_loaded += sign * pages_loaded
        if digest is not None:
            left = self.adapter_rows.get(digest, 0) + sign
            if left:
                self.adapter_rows[digest] = left
            else:
                self.adapter_rows.pop(digest, None)

    def add(self, num_computed: int, n: int, decode: bool, digest: str | None = None,
            pages_loaded: int = 0) -> None:
        """Add a row of ``n`` new tokens after ``num_computed`` cached ones."""
        self._apply(1, num_computed, n, decode, digest, pages_loaded)

    def remove(self, num_computed: int, n: int, decode: bool, digest: str | None = None,
               pages_loaded: int = 0) -> None:
        """Take back a row added with the same arguments."""
        self._apply(-1, num_computed, n, decode, digest, pages_loaded)

    def shape(self) -> StepShape:
        return StepShape(self.num_prefill_tokens, self.num_decode_tokens,
                         self.num_context_tokens, len(self.adapter_rows),
                         self.num_adapter_pages_loaded)

    def with_row(self, num_computed: int, n: int, decode: bool, digest: str | None = None,
                 pages_loaded: int = 0) -> StepShape:
        """The shape this step would have with one more row."""
        new_adapter = digest is not None and digest not in self.adapter_rows
        return StepShape(
            self.num_prefill_tokens + (0 if decode else n),
            self.num_decode_tokens + (n if decode else 0),
            self.num_context_tokens + context_tokens(num_computed, n),
            len(self.adapter_rows) + int(new_adapter),
            self.num_adapter_pages_loaded + pages_loaded)


def nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (an active-set loop: solve on the allowed
    columns, drop the most negative coefficient, repeat; at most one pass per column).

    Args:
        x: ``[rows, features]`` float64.
        y: ``[rows]`` float64.
    Returns:
        ``[features]`` float64, all >= 0.
    """
    num_features = x.shape[1]
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0  # a feature never seen keeps coefficient 0 (min-norm solution)
    xs = x / scale
    allowed = list(range(num_features))
    coef = np.zeros(num_features)
    while allowed:
        sol, *_ = np.linalg.lstsq(xs[:, allowed], y, rcond=None)
        worst = int(np.argmin(sol))
        if sol[worst] >= 0:
            coef[allowed] = sol
            break
        allowed.pop(worst)
    return coef / scale


class StepCostModel:
    """An online least-squares model of step time (seconds) on a step's shape.

    Args:
        window: latest measured steps the fit uses (besides the calibration steps).
        refit_every: steps between refits (a 6-column fit of a few hundred rows is cheap; this
            only bounds the work per step).
    """

    def __init__(self, window: int = 256, refit_every: int = 8) -> None:
        if window < 1 or refit_every < 1:
            raise ValueError("window and refit_every: must be >= 1")
        self.window = window
        self.refit_every = refit_every
        self._anchors: list[tuple[tuple[float, ...], float]] = []
        self._recent: deque[tuple[tuple[float, ...], float]] = deque(maxlen=window)
        self._coef = np.zeros(len(FEATURES))
        self._errors: deque[float] = deque(maxlen=window)
        self._since_fit = 0
        self.num_observed = 0
        self._fastest = 0.0  # the fastest step measured: no step is predicted below it

    def predict(self, shape: StepShape) -> float:
        """Predicted seconds for a step of this shape (0.0 before anything is observed),
        never below the fastest step measured: a noisy fit can give a term nothing (nnls
        zeroes a coefficient), and a prediction of ~0 would let a step take a whole prompt
        under any target."""
        return max(float(np.dot(self._coef, shape.features())), self._fastest)

    def observe(self, shape: StepShape, seconds: float, calibration: bool = False) -> None:
        """Record a measured step. Calibration steps stay in the fit for good; others slide
        through the window. The first observations refit at once, later ones every
        ``refit_every``."""
        row = (shape.features(), float(seconds))
        self._fastest = seconds if not self.num_observed else min(self._fastest, seconds)
        if not calibration and self.num_observed:
            self._errors.append(abs(self.predict(shape) - seconds))
        (self._anchors.append if calibration else self._recent.append)(row)
        self.num_observed += 1
        self._since_fit += 1
        if calibration or self.num_observed <= len(FEATURES) * 2 \
                or self._since_fit >= self.refit_every:
            self.refit()

    def refit(self) -> None:
        rows = self._anchors + list(self._recent)
        if not rows:
            return
        x = np.array([r[0] for r in rows], dtype=np.float64)
        y = np.array([r[1] for r in rows], dtype=np.float64)
        self._coef = nnls(x, y)
        self._since_fit = 0

    @property
    def coefficients(self) -> tuple[float, ...]:
        return tuple(float(c) for c in self._coef)

    @property
    def mean_abs_error_s(self) -> float:
        """|predicted - measured| averaged over the window's steps (0.0 before any)."""
        errors = list(self._errors)
        return sum(errors) / len(errors) if errors else 0.0


@dataclass(frozen=True)
class StepTimeStats:
    """Measured against predicted step time, for ``EngineStats`` and metrics (totals since
    start; a step is timed from scheduling to its outputs, detokenized)."""

    num_steps: int = 0
    seconds: float = 0.0  # measured, summed
    predicted_seconds: float = 0.0  # the cost model's predictions of the same steps, summed
    last_seconds: float = 0.0
    last_predicted_seconds: float = 0.0
    num_over_target: int = 0  # steps measured over target_itl_ms (0 when it is off)
    mean_abs_error_s: float = 0.0  # over the model's window
    coefficients: tuple[float, ...] = ()  # seconds per unit of each of ``FEATURES``


class StepTimer:
    """The engine's side of the cost model: each step's measured time against the prediction
    the scheduler worked with, fed back into the model.

    Args:
        model: the model the scheduler predicts with.
        target_s: the inter-token latency target in seconds (0: none).
    """

    def __init__(self, model: StepCostModel, target_s: float = 0.0) -> None:
        self.model = model
        self.target_s = target_s
        self._stats = StepTimeStats()

    def record(self, shape: StepShape, seconds: float) -> None:
        """Count a step that ran; its prediction is taken before the model learns from it
        (the model refits only here, so it is the one the scheduler used)."""
        predicted = self.model.predict(shape)
        self.model.observe(shape, seconds)
        s = self._stats
        self._stats = StepTimeStats(
            s.num_steps + 1, s.seconds + seconds, s.predicted_seconds + predicted, seconds,
            predicted, s.num_over_target + int(0 < self.target_s < seconds))

    def stats(self) -> StepTimeStats:
        s = self._stats
        return StepTimeStats(s.num_steps, s.seconds, s.predicted_seconds, s.last_seconds,
                             s.last_predicted_seconds, s.num_over_target,
                             self.model.mean_abs_error_s, self.model.coefficients)
