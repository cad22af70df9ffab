"""Fair admission across tenants: the Virtual Token Counter (Sheng et al., OSDI'24).

Each tenant's counter grows by ``(w_in * prompt tokens + w_out * output tokens) / weight`` as
it is served. Among tenants with waiting requests, the one with the smallest counter is
admitted next. A tenant that returns from idle is lifted to the smallest counter among the
tenants still active, so idleness earns no credit. With every tenant continuously backlogged,
any two counters stay within a bound of the most service one step can add.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from loraplex.server.engine.request import Request


class VirtualTokenCounter:
    """Per-tenant service counters and the admission choice they imply."""

    def __init__(self, input_weight: float = 1.0, output_weight: float = 2.0,
                 tenant_weights: Mapping[str, float] | None = None) -> None:
        if input_weight < 0 or output_weight < 0:
            raise ValueError("vtc weights: must be >= 0")
        self.input_weight = input_weight
        self.output_weight = output_weight
        self.tenant_weights = dict(tenant_weights or {})
        self.counters: dict[str, float] = {}

    def _weight(self, tenant: str) -> float:
        return self.tenant_weights.get(tenant, 1.0)

    def on_arrival(self, tenant: str, active_tenants: Iterable[str]) -> None:
        """A request arrives; lift its tenant if it was idle (not among ``active_tenants``)."""
        active = [self.counters[t] for t in active_tenants if t in self.counters and t != tenant]
        if tenant in set(active_tenants):
            return
        floor = min(active) if active else self.counters.get(tenant, 0.0)
        self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)

    def charge(self, tenant: str, input_tokens: int, output_tokens: int) -> None:
        """Count service delivered to ``tenant``."""
        cost = self.input_weight * input_tokens + self.output_weight * output_tokens
        self.counters[tenant] = self.counters.get(tenant, 0.0) + cost / self._weight(tenant)

    def pick(self, waiting: Iterable[Request]) -> Request | None:
        """The oldest waiting request of the tenant with the smallest counter."""
        best: Request | None = None
        best_counter = 0.0
        for req in waiting:  # in queue order, so the first of a tenant is its oldest
            counter = self.counters.get(req.tenant, 0.0)
            if best is None or counter < best_counter:
                best, best_counter = req, counter
        return best
