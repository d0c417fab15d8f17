"""The settings of ``vitflow serve``: one dataclass that the command line fills, the parent process
completes (:func:`vitflow.infer.serve.backends.prepare`: which file, which backend, the version)
and every worker process or Ray replica receives as JSON."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

ENV_VAR = "VITFLOW_SERVE_SETTINGS"  # the prepared settings, as JSON, for the uvicorn worker processes


@dataclass
class ServeSettings:
    """What ``vitflow serve`` serves and how (units in the field comments)."""

    source: str  # a run folder, checkpoint, hub folder, ONNX or INT8 ONNX file
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 16  # images in one model call, at most
    max_wait_ms: float = 5.0  # how long the first image of a batch waits for more (milliseconds)
    max_queue: int = 64  # images admitted and not yet answered (decoding, queued, in the model); past it: 503
    timeout: float = 30.0  # a request's deadline from its arrival (seconds): 408 while uploading, else 504
    workers: int = 1  # server processes (uvicorn's supervisor restarts one that dies)
    threads: int = 0  # PyTorch / ONNX Runtime threads of a worker; 0: the cores divided by the workers
    decode_threads: int = 2  # JPEG/PNG decoding and resizing threads of a worker
    backend: str = "auto"  # auto | eager_fp32 | eager_bf16 | onnxruntime (vitflow.infer.serve.backends)
    device: str = "auto"
    weights: str = "auto"  # auto | ema | raw (checkpoints)
    tta: str | None = None  # test-time views, as `vitflow predict --tta`
    max_body_bytes: int = 20 * 2**20  # request body (bytes); past it: 413
    max_pixels: int = 40_000_000  # width x height of one image; past it: 413
    max_images: int = 32  # images in one request; past it: 413
    topk: int = 5  # classes answered per image unless the request says top_k
    log_json: bool = False  # one JSON object per request log line
    name: str | None = None  # the model's name in answers (default: the source's file or folder name)
    api_key_file: str | None = None  # keys, one per line (with $VITFLOW_SERVE_API_KEYS): the API needs one
    metrics_open: bool = False  # /metrics answers without a key
    auth_failures: int = 10  # failed key attempts per client address per minute before 429; 0: no limit
    tls_cert: str | None = None  # PEM certificate (chain): HTTPS
    tls_key: str | None = None  # its private key (default: in the certificate's file)
    # filled by prepare(): the file each worker loads, the model it comes from (a checkpoint, hub folder or
    # ONNX file) and that model's content hash
    load_path: str | None = None
    origin: str | None = None
    version: str | None = None
    choice: dict | None = None  # auto: the measured images/s of each candidate backend

    def check(self) -> None:
        """Raises ValueError naming the first option out of range."""
        for key in ("max_batch", "max_queue", "workers", "decode_threads", "max_body_bytes", "max_pixels",
                    "max_images", "topk"):
            if getattr(self, key) < 1:
                raise ValueError(f"--{key.replace('_', '-')} must be >= 1 (got {getattr(self, key)})")
        for key in ("max_wait_ms", "threads", "auth_failures"):
            if getattr(self, key) < 0:
                raise ValueError(f"--{key.replace('_', '-')} must be >= 0 (got {getattr(self, key)})")
        if self.timeout <= 0:
            raise ValueError(f"--timeout must be > 0 seconds (got {self.timeout})")
        if self.max_images > self.max_queue:
            raise ValueError(f"--max-images {self.max_images} is over --max-queue {self.max_queue}: such a request "
                             "could never be admitted")
        if self.tls_key and not self.tls_cert:
            raise ValueError("--tls-key without --tls-cert: give the certificate too (one PEM file may hold both)")
        for key in ("tls_cert", "tls_key", "api_key_file"):
            if getattr(self, key) and not os.path.isfile(getattr(self, key)):
                raise ValueError(f"--{key.replace('_', '-')} {getattr(self, key)}: no such file")
        if self.max_queue < self.max_batch:
            raise ValueError(f"--max-queue {self.max_queue} is below --max-batch {self.max_batch}: a full batch "
                             "could never form")

    def torch_threads(self) -> int:
        """The intra-op threads of one worker: ``threads``, or the cores shared out among the workers."""
        return self.threads or max(1, (os.cpu_count() or 1) // self.workers)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "ServeSettings":
        return cls(**json.loads(text))
