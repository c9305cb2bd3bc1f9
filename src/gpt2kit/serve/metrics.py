"""Prometheus metrics of one server (its own registry, so several apps in a process never clash)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self, running: Callable[[], float], waiting: Callable[[], float],
                 steps: Callable[[], float]) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("gpt2kit_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.prompt_tokens = Counter("gpt2kit_prompt_tokens", "prompt tokens processed", registry=r)
        self.generation_tokens = Counter("gpt2kit_generation_tokens", "tokens generated", registry=r)
        self.batch_size = Gauge("gpt2kit_batch_size", "rows in the running batch", registry=r)
        self.queue_length = Gauge("gpt2kit_queue_length", "rows waiting to join the batch", registry=r)
        self.batch_size.set_function(running)
        self.scoring_tokens = Gauge("gpt2kit_scoring_tokens", "prompt tokens admitted for echo log-probs, unscored",
                                    registry=r)
        self.scored_tokens = Counter("gpt2kit_scored_tokens", "prompt tokens scored for echo log-probs", registry=r)
        self.work_tokens = Gauge("gpt2kit_work_tokens", "tokens of work admitted (generation rows' prompt + "
                                 "max_tokens, prompts to score); the limit is (max_batch + max_queue) x n_ctx",
                                 registry=r)
        self.queue_length.set_function(waiting)
        self.engine_steps = Gauge("gpt2kit_engine_steps", "engine steps run since start (a step: one decode forward "
                                  "of the running rows and the joining rows' prefill chunks)", registry=r)
        self.engine_steps.set_function(steps)
        self.prefix_cache_hit_tokens = Counter(
            "gpt2kit_prefix_cache_hit_tokens", "prompt tokens not run through the model (generation and echo "
            "scoring): their keys and values (and, scoring, log-probs) came from the prefix cache", registry=r)
        self.prefix_cache_lookups = Counter("gpt2kit_prefix_cache_lookups", "prompts looked up in the prefix cache",
                                            registry=r)
        self.prefix_cache_hits = Counter("gpt2kit_prefix_cache_hits", "prompts that found a prefix in the prefix "
                                         "cache", registry=r)
        self.prefix_cache_tokens = Gauge("gpt2kit_prefix_cache_tokens", "tokens held by the prefix cache",
                                         registry=r)
        self.ttft = Histogram("gpt2kit_time_to_first_token_seconds", "request arrival to its first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("gpt2kit_time_per_output_token_seconds", "time between a row's tokens",
                              buckets=_LATENCY_BUCKETS, registry=r)

    def prefix_cache_lookup(self, reused: int) -> None:
        """One prefix-cache lookup that spared the model `reused` prompt tokens (0: a miss)."""
        self.prefix_cache_lookups.inc()
        if reused:
            self.prefix_cache_hits.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
