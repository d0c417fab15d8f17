"""``vitflow serve --ray --replicas N``: the same application as a Ray Serve deployment.

Each replica is a Ray actor running :func:`vitflow.infer.serve.app.create_app`'s FastAPI
application (``serve.ingress``): its own model, decoding pool, dynamic batcher, limits and
metrics, exactly as a uvicorn worker. Ray Serve's HTTP proxy spreads requests over the replicas,
refuses past ``max_queued_requests`` with 503, and its controller replaces a replica that dies
(health-checked every 2 s); requests in flight on a dead replica get an error answer from the
proxy. ``/metrics`` is answered by one replica (its own figures); Ray exports its own metrics too.

``ray.init()`` joins the cluster named by ``RAY_ADDRESS`` when set, else starts a local Ray
instance (no dashboard). Replicas read the model file at the path the driver prepared: on a
cluster of several machines, that path must be on storage every node sees.
"""

from __future__ import annotations

import dataclasses
import signal
import tempfile
import threading
from typing import Callable

from vitflow.infer.serve.app import create_app
from vitflow.infer.serve.backends import prepare
from vitflow.infer.serve.settings import ServeSettings

APP_NAME = "vitflow"


def deploy(settings: ServeSettings, replicas: int) -> None:
    """Deploy prepared ``settings`` on the running Ray instance as application ``vitflow`` at
    route ``/``, with Ray's HTTP proxy on ``settings.host:settings.port``, and wait until every
    replica is up (its model loaded and warmed up).

    ``settings.threads`` (or the cores shared by the replicas) is each replica's ``num_cpus`` and
    its PyTorch / ONNX Runtime thread count.

    Raises:
        RuntimeError: a replica could not start (Ray's message).
    """
    from ray import serve

    settings = dataclasses.replace(settings, workers=replicas)
    app = create_app(settings)

    @serve.deployment(name="VitflowReplica", num_replicas=replicas,
                      ray_actor_options={"num_cpus": settings.torch_threads()},
                      max_ongoing_requests=settings.max_queue, max_queued_requests=settings.max_queue * replicas,
                      health_check_period_s=2.0, health_check_timeout_s=30.0,
                      graceful_shutdown_timeout_s=settings.timeout + 5)
    @serve.ingress(app)
    class VitflowReplica:
        pass

    serve.start(http_options={"host": settings.host, "port": settings.port})
    serve.run(VitflowReplica.bind(), name=APP_NAME, route_prefix="/", blocking=False)


def run_ray(settings: ServeSettings, replicas: int, say: Callable[[str], None] = print) -> int:
    """Start (or join) Ray, deploy, serve until SIGTERM / SIGINT, then shut the application down
    (replicas finish their requests) and return 0."""
    import ray
    from ray import serve

    with tempfile.TemporaryDirectory(prefix="vitflow-serve-") as tmp:
        prepared = prepare(settings, tmp, say)
        ray.init(include_dashboard=False, log_to_driver=False)
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        try:
            deploy(prepared, replicas)
            say(f"serving {prepared.name} ({prepared.version}, backend {prepared.backend}) on Ray Serve with "
                f"{replicas} replica(s) at http://{prepared.host}:{prepared.port}; API docs at /docs")
            stop.wait()
            say("stopping: the replicas answer what they hold, then exit")
            serve.delete(APP_NAME)
        finally:
            serve.shutdown()
            ray.shutdown()
    return 0
