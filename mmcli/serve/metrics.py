"""The server's Prometheus metrics (prometheus_client), one registry an app: requests by route and
status, the queue, what is being prepared and decoded, tokens, time to first token, latency, and
the images and video frames read. docs/serve.md lists them."""

from __future__ import annotations

from functools import partial

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

# seconds: a tiny model's first token in milliseconds, a 2B model's caption on 2 cores in tens
TIME_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300, 600)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = CollectorRegistry()
        counter = partial(Counter, registry=self.registry)
        gauge = partial(Gauge, registry=self.registry)
        timing = partial(Histogram, buckets=TIME_BUCKETS, registry=self.registry)
        self.requests = counter(
            "mmcli_requests", "HTTP requests answered, by route and status", ["route", "status"]
        )
        self.queued = gauge("mmcli_queued_requests", "admitted, sequences not started")
        self.preparing = gauge("mmcli_preparing_requests", "media being fetched and decoded")
        self.running = gauge("mmcli_running_sequences", "sequences in the engine")
        self.prompt_tokens = counter("mmcli_prompt_tokens", "of finished sequences")
        self.generation_tokens = counter("mmcli_generation_tokens", "generated, finished ones")
        self.time_to_first_token = timing(
            "mmcli_time_to_first_token_seconds", "from admission to a sequence's first token"
        )
        self.latency = timing("mmcli_request_latency_seconds", "admission to a sequence's end")
        self.images = counter("mmcli_images", "images decoded for requests")
        self.video_frames = counter("mmcli_video_frames", "video frames sampled for requests")

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
