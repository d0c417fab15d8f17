"""``vitflow serve``: a trained model behind an HTTP service with dynamic batching.

- :mod:`.settings`: the options (:class:`ServeSettings`);
- :mod:`.backends`: which backend serves the model (``--backend auto`` times them), prepared once;
- :mod:`.service`: one worker's model thread, decoding pool, batchers and admission bound;
- :mod:`.batcher`: dynamic batching with a bounded admission and per-request deadlines;
- :mod:`.inputs`: the request body and its images (raw, multipart, JSON/base64), with limits;
- :mod:`.app`: the FastAPI application (routes, errors, access log);
- :mod:`.metrics`: the Prometheus metrics;
- :mod:`.server`: uvicorn workers under uvicorn's supervisor, SIGTERM drain;
- :mod:`.ray`: the same application as a Ray Serve deployment (``--ray --replicas N``);
- :mod:`.triton`: ``vitflow export --format triton`` (a Triton model repository).

Guide: docs/guides/serving.md.
"""

from vitflow.infer.serve.settings import ServeSettings

__all__ = ["ServeSettings"]
