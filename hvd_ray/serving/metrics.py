"""The model replica's Serve metrics: Prometheus series via Ray's metrics agent, tagged per replica
by Serve; the engine loop and the request path update them."""


class ReplicaMetrics:
    """A few real Serve metrics (Prometheus via Ray's metrics agent), tagged per replica by Serve."""

    def __init__(self) -> None:
        from ray.serve import metrics

        self.requests = metrics.Counter(
            "hvd_requests_total", "Finished generation requests.", tag_keys=("finish_reason",)
        )
        self.tokens = metrics.Counter("hvd_generated_tokens_total", "Generated (completion) tokens.")
        self.forwards = metrics.Counter("hvd_target_forwards_total", "Target forwards (prefill included).")
        self.ttft = metrics.Histogram(
            "hvd_time_to_first_token_seconds",
            "Time from arrival to the first token.",
            boundaries=[0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30],
        )
        self.mat = metrics.Gauge(
            "hvd_mean_accepted_tokens_per_forward",
            "Mean tokens emitted per decoding target forward since the replica started.",
        )
        self.cache_rate = metrics.Gauge(
            "hvd_cache_chosen_rate",
            "Share of decode steps that verified a suffix-cache draft, since the replica started.",
        )
        self.slim = metrics.Counter(
            "hvd_slim_tokens_total", "VIA-SD slim-tier outcomes per draft token.", tag_keys=("outcome",)
        )
        self.waiting = metrics.Gauge("hvd_queue_length", "Requests waiting for a KV-cache slot.")
        self.running = metrics.Gauge("hvd_running_requests", "Requests holding a KV-cache slot.")
