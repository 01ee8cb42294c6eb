"""Prometheus series of the server: KV blocks, prefix hit rate and hits per tier (device pool, host tier), the host
tier's blocks, preemptions, queue, rejections, engine steps and the tokens they forwarded, TTFT and inter-token
latency; and under vLLM's names and ``model_name`` label, what vLLM's dashboards read: ``vllm:num_requests_running``
/ ``_waiting``, ``vllm:kv_cache_usage_perc``, ``vllm:prefix_cache_queries`` / ``_hits``, ``vllm:num_preemptions``,
``vllm:prompt_tokens`` / ``vllm:generation_tokens``, ``vllm:request_success`` (by finished_reason), the TTFT,
inter-token and end-to-end latency histograms, and speculative decoding's ``vllm:spec_decode_*`` counters.

Inter-token latency is what the server sees: the time between a request's outputs, so only streamed requests (one
output per step) give it; a request answered whole gives its TTFT and end-to-end latency."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ServerMetrics:
    """Prometheus series of one server (own registry, so several apps can live in one process)."""

    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.model_name = model_name
        named = ["model_name"]
        self.vllm_running = Gauge("vllm:num_requests_running", "requests running", named, registry=r)
        self.vllm_waiting = Gauge("vllm:num_requests_waiting", "requests waiting", named, registry=r)
        self.vllm_kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = full)", named, registry=r)
        self.vllm_prefix_queries = Counter("vllm:prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                                           named, registry=r)
        self.vllm_prefix_hits = Counter("vllm:prefix_cache_hits", "prompt tokens found in the prefix cache", named,
                                        registry=r)
        self.vllm_preemptions = Counter("vllm:num_preemptions", "preemptions", named, registry=r)
        self.vllm_prompt_tokens = Counter("vllm:prompt_tokens", "prompt tokens of finished requests", named,
                                          registry=r)
        self.vllm_generation_tokens = Counter("vllm:generation_tokens", "tokens generated", named, registry=r)
        self.vllm_success = Counter("vllm:request_success", "finished requests", named + ["finished_reason"],
                                    registry=r)
        self.vllm_ttft = Histogram("vllm:time_to_first_token_seconds", "arrival to first token", named, registry=r,
                                   buckets=_LATENCY_BUCKETS)
        self.vllm_itl = Histogram("vllm:inter_token_latency_seconds", "time between a streamed request's outputs",
                                  named, registry=r, buckets=_LATENCY_BUCKETS)
        self.vllm_e2e = Histogram("vllm:e2e_request_latency_seconds", "arrival to the last output", named,
                                  registry=r, buckets=_LATENCY_BUCKETS)
        self.blocks_used = Gauge("paged_hf_kv_cache_blocks_used", "KV blocks in use", registry=r)
        self.blocks_total = Gauge("paged_hf_kv_cache_blocks_total", "KV blocks in the pool", registry=r)
        self.prefix_hit_rate = Gauge("paged_hf_prefix_cache_hit_rate", "prefix-cache hits / queries (tokens)", registry=r)
        self.prefix_queries = Gauge("paged_hf_prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                                    registry=r)
        self.prefix_hits = Gauge("paged_hf_prefix_cache_hits", "prompt tokens found cached, by tier", ["tier"],
                                 registry=r)
        self.host_blocks = Gauge("paged_hf_host_cache_blocks_used", "KV blocks held by the host tier", registry=r)
        self.preemptions = Gauge("paged_hf_preemptions", "sequences preempted since start", registry=r)
        self.steps = Gauge("paged_hf_engine_steps", "engine steps that ran a forward since start", registry=r)
        self.step_tokens = Gauge("paged_hf_engine_step_tokens", "tokens those steps forwarded (prompt chunks and "
                                 "decodes; per step: divide by paged_hf_engine_steps)", registry=r)
        self.running = Gauge("paged_hf_requests_running", "sequences running", registry=r)
        self.waiting = Gauge("paged_hf_requests_waiting", "sequences waiting", registry=r)
        self.tensor_parallel_size = Gauge("paged_hf_tensor_parallel_size",
                                          "ranks the model and each KV block are split over", registry=r)
        self.rejected = Counter("paged_hf_requests_rejected", "requests answered 503 (queue full)", registry=r)
        self.ttft = Histogram("paged_hf_time_to_first_token_seconds", "arrival to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.itl = Histogram("paged_hf_inter_token_latency_seconds", "time between output updates", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.spec_drafts = Counter("vllm:spec_decode_num_drafts", "verified runs with speculative drafts", named,
                                   registry=r)
        self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "speculative draft tokens proposed",
                                         named, registry=r)
        self.spec_accepted = Counter("vllm:spec_decode_num_accepted_tokens", "speculative draft tokens accepted",
                                     named, registry=r)
        self.spec_accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                             "accepted draft tokens at each draft position", [*named, "position"],
                                             registry=r)
        # id of a counter (a labelled child too: prometheus_client keeps each) -> the engine's total when last rendered
        self._totals_seen: dict[int, int] = {}
        self._last: dict[str, float] = {}  # request id -> when its last output came (unfinished requests only)

    def observe(self, out, now: float) -> None:
        """Called by the engine loop with each ``RequestOutput``."""
        previous = self._last.get(out.request_id)
        name = self.model_name
        if previous is None and out.metrics is not None and out.metrics.first_token_time is not None:
            self.ttft.observe(out.metrics.first_token_time - out.metrics.arrival_time)
            self.vllm_ttft.labels(name).observe(out.metrics.first_token_time - out.metrics.arrival_time)
        elif previous is not None:
            self.itl.observe(now - previous)
            self.vllm_itl.labels(name).observe(now - previous)
        if out.finished:
            self._last.pop(out.request_id, None)
            self.vllm_prompt_tokens.labels(name).inc(len(out.prompt_token_ids or ()))
            for completion in out.outputs:
                self.vllm_success.labels(name, completion.finish_reason or "abort").inc()
            if out.metrics is not None:
                self.vllm_e2e.labels(name).observe(now - out.metrics.arrival_time)
        else:
            self._last[out.request_id] = now

    def aborted(self, request_id: str) -> None:
        """Called by the engine loop for a request aborted before it finished (a client gone): no output follows, so
        its last output's time is dropped here."""
        self._last.pop(request_id, None)

    def render(self, stats) -> bytes:
        """The series, with the gauges set from ``stats`` (an ``EngineStats``)."""
        self.blocks_used.set(stats.kv_cache_used)
        self.blocks_total.set(stats.kv_cache_total)
        self.prefix_hit_rate.set(stats.prefix_cache_hit_rate)
        self.prefix_queries.set(stats.prefix_cache_queries)
        self.prefix_hits.labels(tier="device").set(stats.prefix_cache_hits - stats.prefix_cache_host_hits)
        self.prefix_hits.labels(tier="host").set(stats.prefix_cache_host_hits)
        self.host_blocks.set(stats.host_cache_blocks_used)
        self.preemptions.set(stats.preemption_count)
        self.steps.set(stats.num_steps)
        self.step_tokens.set(stats.num_step_tokens)
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.tensor_parallel_size.set(stats.tensor_parallel_size)
        name = self.model_name
        self.vllm_running.labels(name).set(stats.num_running)
        self.vllm_waiting.labels(name).set(stats.num_waiting)
        self.vllm_kv_usage.labels(name).set(stats.kv_cache_used / stats.kv_cache_total if stats.kv_cache_total else 0)
        totals = [(self.vllm_prefix_queries.labels(name), stats.prefix_cache_queries),
                  (self.vllm_prefix_hits.labels(name), stats.prefix_cache_hits),
                  (self.vllm_preemptions.labels(name), stats.preemption_count),
                  (self.vllm_generation_tokens.labels(name), stats.generated_tokens),
                  (self.spec_drafts.labels(name), stats.spec_decode_num_drafts),
                  (self.spec_draft_tokens.labels(name), stats.spec_decode_num_draft_tokens),
                  (self.spec_accepted.labels(name), stats.spec_decode_num_accepted_tokens)]
        totals += [(self.spec_accepted_per_pos.labels(name, str(j)), n)
                   for j, n in enumerate(stats.spec_decode_num_accepted_tokens_per_pos)]
        for counter, total in totals:  # the engine keeps totals; a counter only grows by the difference
            counter.inc(max(total - self._totals_seen.get(id(counter), 0), 0))
            self._totals_seen[id(counter)] = total
        return generate_latest(self.registry)
