"""The random pieces of a trace: inter-arrival gaps, adapter popularity, token lengths.

Each sampler takes a ``numpy.random.Generator`` and a count and returns a numpy array, so one
seed gives one trace. Every distribution is parsed from a short spec string (the CLI's form)
and printed back by ``str()``:

* arrivals: a Gamma process of rate ``rate`` and ``burstiness`` k (the Gamma shape, vLLM's
  term): k = 1 is Poisson, k < 1 is burstier (coefficient of variation 1/sqrt(k)), k > 1
  smoother;
* adapters (Punica's popularity patterns, as streams): ``zipf:A`` (P(k) ~ k^-A over N),
  ``uniform``, ``identical`` (one adapter), ``distinct`` (a new adapter per request),
  ``skewed:F`` (one hot adapter takes a fraction F, the rest share 1 - F uniformly);
* lengths: ``fixed:N``, ``uniform:LO:HI``, ``normal:MEAN:STD``, ``lognormal:MEDIAN:SIGMA``,
  ``exponential:MEAN``, rounded and clipped to ``[1, max]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

POPULARITY_KINDS = ("zipf", "uniform", "identical", "distinct", "skewed")
LENGTH_KINDS = ("fixed", "uniform", "normal", "lognormal", "exponential")
_LENGTH_ARITY = {"fixed": 1, "uniform": 2, "normal": 2, "lognormal": 2, "exponential": 1}


def unit_gaps(rng: np.random.Generator, n: int, burstiness: float = 1.0) -> np.ndarray:
    """``n`` inter-arrival gaps of mean 1: Gamma(shape=burstiness, scale=1/burstiness).

    Dividing by a rate gives that rate's gaps, so traces of one seed at different rates
    share their random numbers (a sweep compares the same arrival pattern, scaled).
    """
    if not burstiness > 0:
        raise ValueError(f"burstiness: must be > 0, got {burstiness}")
    return rng.gamma(burstiness, 1.0 / burstiness, size=n)


def arrival_times(rng: np.random.Generator, n: int, rate: float,
                  burstiness: float = 1.0) -> np.ndarray:
    """Arrival times in seconds of ``n`` requests at ``rate`` requests/s; the first arrives
    after one gap. ``rate = inf`` sends everything at time 0 (the same draws are made)."""
    if not rate > 0:
        raise ValueError(f"rate: must be > 0 requests/s, got {rate}")
    gaps = unit_gaps(rng, n, burstiness)
    if math.isinf(rate):
        return np.zeros(n)
    return np.cumsum(gaps) / rate


@dataclass(frozen=True)
class Popularity:
    """Which adapter each request names, as an index in ``[0, num_adapters)``.

    Attributes:
        kind: one of ``POPULARITY_KINDS``.
        param: the Zipf exponent A (> 0) for ``zipf``, the hot fraction F in (0, 1] for
            ``skewed``; unused otherwise.
    """

    kind: str = "zipf"
    param: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in POPULARITY_KINDS:
            raise ValueError(f"adapters: {self.kind!r} is not one of {POPULARITY_KINDS}")
        if self.kind == "zipf" and not self.param > 0:
            raise ValueError(f"adapters: the zipf exponent must be > 0, got {self.param}")
        if self.kind == "skewed" and not 0 < self.param <= 1:
            raise ValueError(f"adapters: the skewed hot fraction must be in (0, 1], "
                             f"got {self.param}")

    @classmethod
    def parse(cls, spec: str) -> Popularity:
        """``"zipf:1.0"``, ``"uniform"``, ``"identical"``, ``"distinct"``, ``"skewed:0.9"``
        (``zipf`` alone is A = 1, ``skewed`` alone is F = 0.9)."""
        kind, _, arg = spec.partition(":")
        default = {"zipf": 1.0, "skewed": 0.9}.get(kind, 0.0)
        try:
            param = float(arg) if arg else default
        except ValueError:
            raise ValueError(f"adapters: {spec!r} has a non-numeric parameter") from None
        return cls(kind, param)

    def __str__(self) -> str:
        return f"{self.kind}:{self.param:g}" if self.kind in ("zipf", "skewed") else self.kind

    def probabilities(self, num_adapters: int) -> np.ndarray:
        """P(adapter k) for k in ``[0, num_adapters)`` (``distinct`` has none: it is a
        sequence, not a distribution)."""
        if num_adapters < 1:
            raise ValueError(f"num_adapters: must be >= 1, got {num_adapters}")
        if self.kind == "zipf":
            w = np.arange(1, num_adapters + 1, dtype=np.float64) ** -self.param
            return w / w.sum()
        if self.kind == "uniform":
            return np.full(num_adapters, 1.0 / num_adapters)
        if self.kind == "identical":
            return np.eye(1, num_adapters).ravel()
        if self.kind == "skewed":
            if num_adapters == 1:
                return np.ones(1)
            rest = (1.0 - self.param) / (num_adapters - 1)
            return np.array([self.param] + [rest] * (num_adapters - 1))
        raise ValueError("adapters: 'distinct' has no probabilities")

    def sample(self, rng: np.random.Generator, n: int, num_adapters: int) -> np.ndarray:
        """Adapter indices of ``n`` requests (``distinct``: 0, 1, 2, ... wrapping at N)."""
        if self.kind == "distinct":
            if num_adapters < 1:
                raise ValueError(f"num_adapters: must be >= 1, got {num_adapters}")
            return np.arange(n) % num_adapters
        u = rng.random(n)
        cdf = np.cumsum(self.probabilities(num_adapters))
        return np.minimum(np.searchsorted(cdf, u * cdf[-1], side="right"), num_adapters - 1)


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution.

    Attributes:
        kind: one of ``LENGTH_KINDS``.
        params: ``fixed`` (N,), ``uniform`` (LO, HI) inclusive, ``normal`` (MEAN, STD),
            ``lognormal`` (MEDIAN, SIGMA), ``exponential`` (MEAN,).
    """

    kind: str
    params: tuple[float, ...]

    def __post_init__(self) -> None:
        if self.kind not in LENGTH_KINDS:
            raise ValueError(f"length: {self.kind!r} is not one of {LENGTH_KINDS}")
        object.__setattr__(self, "params", tuple(float(p) for p in self.params))
        if len(self.params) != _LENGTH_ARITY[self.kind]:
            raise ValueError(f"length: {self.kind} takes {_LENGTH_ARITY[self.kind]} "
                             f"parameter(s), got {len(self.params)}")
        if any(not math.isfinite(p) or p < 0 for p in self.params):
            raise ValueError(f"length: parameters must be finite and >= 0, got {self.params}")
        if self.kind == "uniform" and self.params[0] > self.params[1]:
            raise ValueError(f"length: uniform needs LO <= HI, got {self.params}")
        if self.kind in ("fixed", "lognormal", "exponential") and self.params[0] < 1:
            raise ValueError(f"length: {self.kind} needs a first parameter >= 1")

    @classmethod
    def parse(cls, spec: str) -> LengthDist:
        """``"fixed:128"``, ``"uniform:16:256"``, ``"normal:128:32"``,
        ``"lognormal:128:0.5"``, ``"exponential:128"``; a bare number is ``fixed``."""
        kind, *args = spec.split(":")
        if not args and kind.replace(".", "", 1).isdigit():
            kind, args = "fixed", [kind]
        try:
            return cls(kind, tuple(float(a) for a in args))
        except ValueError as exc:
            raise ValueError(f"{exc} (in {spec!r})") from None

    def __str__(self) -> str:
        return ":".join([self.kind, *(f"{p:g}" for p in self.params)])

    @property
    def mean(self) -> float:
        """The mean before rounding and clipping."""
        p = self.params
        if self.kind == "uniform":
            return (p[0] + p[1]) / 2
        if self.kind == "lognormal":
            return p[0] * math.exp(p[1] ** 2 / 2)
        return p[0]

    def sample(self, rng: np.random.Generator, n: int, max_len: int | None = None
               ) -> np.ndarray:
        """``n`` integer lengths in ``[1, max_len]``."""
        p = self.params
        if self.kind == "fixed":
            x = np.full(n, p[0])
        elif self.kind == "uniform":
            x = rng.integers(int(p[0]), int(p[1]) + 1, size=n).astype(np.float64)
        elif self.kind == "normal":
            x = rng.normal(p[0], p[1], size=n)
        elif self.kind == "lognormal":
            x = p[0] * np.exp(rng.normal(0.0, p[1], size=n))
        else:
            x = rng.exponential(p[0], size=n)
        high = max_len if max_len is not None else np.iinfo(np.int64).max
        return np.clip(np.rint(x), 1, high).astype(np.int64)
