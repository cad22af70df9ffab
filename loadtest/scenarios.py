"""Named traces: the standard benchmark and the two multi-tenant ones of the prefix-cache and
fairness work.

* ``standard``: 300 requests, Poisson at 2/s (a load transformers + peft still sustains on
  two CPU cores with the demo model), 64 adapters with Zipf(1) popularity, prompts 32-256
  tokens, outputs 16-128 tokens: the benchmark the README quotes.
* ``shared-prefix``: every prompt starts with the same 1,000-token system prompt followed by
  a short question (8-32 tokens), 8 adapters uniformly: compare TTFT with and without the
  prefix cache (``--enable-prefix-caching`` / ``--no-enable-prefix-caching``).
* ``noisy-neighbour``: tenant ``quiet`` sends Poisson arrivals at ``rate``; tenant ``noisy``
  sends ten times that, in bursts (Gamma, burstiness 0.5): compare each tenant's p99 under
  ``--scheduling fcfs`` and ``vtc``. Fairness only shows when requests queue, so run it with a
  small ``--max-num-seqs`` or above the server's capacity.
"""

from __future__ import annotations

from dataclasses import replace

from loraplex.loadtest.trace import Trace, TraceConfig, generate_trace, merge_traces

SCENARIOS = ("standard", "shared-prefix", "noisy-neighbour")


def standard_config(num_requests: int = 300, rate: float = 2.0, seed: int = 0) -> TraceConfig:
    return TraceConfig(num_requests=num_requests, rate=rate, adapters="zipf:1",
                       num_adapters=64, prompt_len="uniform:32:256",
                       output_len="uniform:16:128", seed=seed)


def shared_prefix_config(num_requests: int = 200, rate: float = 2.0, seed: int = 0,
                         prefix_len: int = 1000) -> TraceConfig:
    return TraceConfig(num_requests=num_requests, rate=rate, adapters="uniform", num_adapters=8,
                       prompt_len="uniform:8:32", output_len="fixed:16", prefix_len=prefix_len,
                       num_prefixes=1, max_prompt_len=64, seed=seed)


def noisy_neighbour_trace(num_requests: int = 330, rate: float = 1.0, seed: int = 0,
                          ratio: float = 10.0) -> Trace:
    """``quiet`` at ``rate`` and ``noisy`` at ``ratio * rate``, ``num_requests`` in all, over
    the same span of time; the same prompt and output lengths for both."""
    num_quiet = max(1, round(num_requests / (1 + ratio)))
    base = TraceConfig(num_requests=num_quiet, rate=rate, adapters="uniform", num_adapters=4,
                       prompt_len="uniform:32:128", output_len="uniform:32:96", seed=seed)
    quiet = replace(base, tenants=(("quiet", 1.0),))
    noisy = replace(base, tenants=(("noisy", 1.0),), num_requests=num_requests - num_quiet,
                    rate=rate * ratio, burstiness=0.5, seed=seed + 1)
    return merge_traces([generate_trace(quiet), generate_trace(noisy)], ["quiet", "noisy"])


def scenario_trace(name: str, num_requests: int | None = None, rate: float | None = None,
                   seed: int = 0) -> Trace:
    """The named scenario's trace (``SCENARIOS``); None keeps the scenario's default."""
    kwargs: dict = {"seed": seed}
    if num_requests is not None:
        kwargs["num_requests"] = num_requests
    if rate is not None:
        kwargs["rate"] = rate
    if name == "standard":
        return generate_trace(standard_config(**kwargs))
    if name == "shared-prefix":
        return generate_trace(shared_prefix_config(**kwargs))
    if name == "noisy-neighbour":
        return noisy_neighbour_trace(**kwargs)
    raise ValueError(f"scenario: {name!r} is not one of {SCENARIOS}")
