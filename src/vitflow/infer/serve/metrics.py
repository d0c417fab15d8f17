"""The service's Prometheus metrics (``GET /metrics``, the text exposition format), through the
``prometheus_client`` library.

With several worker processes, ``PROMETHEUS_MULTIPROC_DIR`` is set by the server before the
workers start: each process writes its values to files there and ``/metrics`` (answered by any
worker) adds them up (``prometheus_client``'s multiprocess mode; gauges summed over live
processes). Names and labels (all ``vitflow_serve_*``):

================================  ==========  =====================================================
``requests_total``                counter     requests answered, by ``route`` and ``status``
``errors_total``                  counter     error answers by ``kind`` (``bad_image``, ``overloaded``, ...)
``images_total``                  counter     images run through the model, by ``route``
``request_seconds``               histogram   time from arrival to answer, by ``route``
``queue_seconds``                 histogram   an image's wait from admission to its model call
``model_seconds``                 histogram   one model call (a batch)
``batch_size``                    histogram   images per model call
``inflight_images``               gauge       images admitted and not yet answered (bounded by --max-queue)
``queued_images``                 gauge       images decoded and waiting for a model call
``auth_failures_total``           counter     requests refused for their API key, by ``reason`` (missing, wrong, limited)
``model_info``                    gauge       1, labelled with the model's ``name``, ``version``, ``backend``
================================  ==========  =====================================================
"""

from __future__ import annotations

import os
from pathlib import Path

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _multiprocess_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR")


class Metrics:
    """The service's metrics, registered in a registry of their own (so that several services can
    live in one process, as in the tests). ``batch_buckets``: the upper bounds of the batch-size
    histogram (powers of two up to and including ``--max-batch``)."""

    def __init__(self, max_batch: int):
        self.registry = CollectorRegistry()
        r, p = self.registry, "vitflow_serve_"
        self.requests = Counter(p + "requests_total", "requests answered", ["route", "status"], registry=r)
        self.errors = Counter(p + "errors_total", "error answers by kind", ["kind"], registry=r)
        self.images = Counter(p + "images_total", "images run through the model", ["route"], registry=r)
        self.request_seconds = Histogram(p + "request_seconds", "arrival to answer", ["route"],
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.queue_seconds = Histogram(p + "queue_seconds", "admission to model call, per image",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.model_seconds = Histogram(p + "model_seconds", "one model call", buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram(p + "batch_size", "images per model call", buckets=batch_buckets(max_batch),
                                    registry=r)
        self.inflight = Gauge(p + "inflight_images", "images admitted, not yet answered", registry=r,
                              multiprocess_mode="livesum")
        self.queued = Gauge(p + "queued_images", "images waiting for a model call", registry=r,
                            multiprocess_mode="livesum")
        self.auth_failures = Counter(p + "auth_failures_total", "requests refused for their API key, by reason "
                                     "(missing, wrong, limited)", ["reason"], registry=r)
        self.info = Gauge(p + "model_info", "the model served", ["name", "version", "backend"], registry=r,
                          multiprocess_mode="max")

    def render(self) -> tuple[bytes, str]:
        """The exposition text of this process, or of every worker process in multiprocess mode,
        and its content type."""
        folder = _multiprocess_dir()
        if not folder:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        _forget_dead_workers(folder)
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=folder)
        return generate_latest(registry), CONTENT_TYPE_LATEST


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """``1, 2, 4, ...`` below ``max_batch``, then ``max_batch``."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return (*out, max_batch)


def _forget_dead_workers(folder: str) -> None:
    """Drop the live gauges of worker processes that died (a worker killed and restarted by the
    supervisor), so that ``inflight_images`` / ``queued_images`` sum the living ones only."""
    pids = {int(f.stem.rsplit("_", 1)[1]) for f in Path(folder).glob("gauge_live*_*.db")
            if f.stem.rsplit("_", 1)[1].isdigit()}
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            multiprocess.mark_process_dead(pid, folder)
        except PermissionError:
            pass
