"""The model side of the service in one worker process: the :class:`Predictor` on its own thread,
a pool of decoding threads beside it, one :class:`~vitflow.infer.serve.batcher.Batcher` per route
and the admission bound.

A request's images are decoded and resized in the pool (libjpeg-turbo and the resize release the
GIL) while the model thread runs the previous batch, so the model never waits for decoding; the
decoding is the one of ``vitflow predict`` (:func:`vitflow.data.decode.decode_image`, then the
checkpoint's :func:`~vitflow.data.transforms.eval_transform`), so the answers are the same.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from vitflow.data import CorruptImageError, decode_image, model_input
from vitflow.data.decode import image_size
from vitflow.data.transforms import eval_view
from vitflow.infer.features.attention import attention_maps
from vitflow.infer.features.embed import pooled_features
from vitflow.infer.predict import Predictor, is_exported
from vitflow.infer.runtimes.onnx import RuntimeModel
from vitflow.infer.serve.backends import load_predictor
from vitflow.infer.serve.batcher import Admission, Batcher, BatchInfo, Overloaded
from vitflow.infer.serve.inputs import RequestError, Upload
from vitflow.infer.serve.metrics import Metrics, batch_buckets
from vitflow.infer.serve.settings import ServeSettings
from vitflow.infer.tta import TTAModel

log = logging.getLogger("vitflow.serve")
ROUTES = ("classify", "embed")


class Service:
    """One worker's model, pools, batchers and metrics. ``start()`` loads and warms the model
    (``ready`` turns true after); ``stop()`` answers what is queued and frees the threads."""

    def __init__(self, settings: ServeSettings):
        self.s = settings
        self.metrics = Metrics(settings.max_batch)
        self.ready = False
        self.predictor: Predictor | None = None
        self.embedder: torch.nn.Module | None = None
        self.batchers: dict[str, Batcher] = {}
        self.admission = Admission(settings.max_queue, self._rate, self.metrics.inflight)
        self._model_thread = ThreadPoolExecutor(1, thread_name_prefix="vitflow-model")
        self._decode_pool = ThreadPoolExecutor(settings.decode_threads, thread_name_prefix="vitflow-decode")

    def _rate(self) -> float:
        return max((b.images_per_s for b in self.batchers.values()), default=0.0)

    @property
    def info(self) -> dict:
        """The model as every answer names it."""
        p = self.predictor
        return {"name": self.s.name, "version": self.s.version, "backend": self.s.backend, "task": p.task,
                "classes": len(p.classes), "image_size": p.pp.image_size, "tta": p.tta,
                **({"threshold": p.threshold} if p.task == "multilabel" else {})}

    def _load(self) -> None:
        """Load the model and run it once at each batch-size bucket (autotuning, allocations)."""
        torch.set_num_threads(self.s.torch_threads())  # before an ONNX Runtime session takes its thread count
        t0 = time.perf_counter()
        self.predictor = p = load_predictor(self.s)
        self.embedder = _features_model(p)
        size = p.pp.image_size
        for b in batch_buckets(self.s.max_batch):
            p.predict(torch.zeros(b, 3, size, size, dtype=torch.uint8))
        self._embed_with = p
        if self.embedder is not None:
            self._features(torch.zeros(1, 3, size, size, dtype=torch.uint8))
        log.info("model %s (%s, %s) loaded and warmed up in %.1f s", self.s.name, self.s.backend, self.s.version,
                 time.perf_counter() - t0)

    def _torch(self) -> tuple[torch.nn.Module, Predictor]:
        """The PyTorch model (without TTA) and its predictor, for ``/v1/embed`` and ``/v1/attention``:
        the served one, or for an ONNX / OpenVINO backend serving a checkpoint the checkpoint's own,
        loaded on the first call (on the model thread)."""
        if self.embedder is None:
            self._embed_with = load_predictor(dataclasses.replace(self.s, backend="eager_fp32", load_path=self.s.origin,
                                                                  tta=None))
            self.embedder = _features_model(self._embed_with)
        return self.embedder, self._embed_with

    @property
    def has_torch_model(self) -> bool:
        """Whether ``/v1/embed`` and ``/v1/attention`` can answer (a PyTorch model is served or can be
        loaded from the checkpoint the served file was exported from)."""
        return self.embedder is not None or not is_exported(self.s.origin or self.s.source)

    def _features(self, images: torch.Tensor) -> torch.Tensor:
        """Pooled features ``float32 (B, D)`` (:meth:`_torch`'s model)."""
        model, p = self._torch()
        return pooled_features(model, model_input(images, p.pp.mean, p.pp.std, p.device, p.dtype))

    def _attention(self, pixels: torch.Tensor) -> dict:
        """:func:`~vitflow.infer.features.attention.attention_maps` of :meth:`_torch`'s model on one
        ``uint8 (3, S, S)`` image (on the model thread, between batches)."""
        model, p = self._torch()
        return attention_maps(model, model_input(pixels[None], p.pp.mean, p.pp.std, p.device, p.dtype))

    def _on_batch(self, route: str, info: BatchInfo) -> None:
        self.metrics.batch_size.observe(info.size)
        self.metrics.model_seconds.observe(info.model_s)
        self.metrics.images.labels(route).inc(info.size)

    async def start(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._model_thread, self._load)
        runs = {"classify": self.predictor.predict, "embed": self._features}
        for route in ROUTES:
            self.batchers[route] = Batcher(runs[route], self._model_thread, self.s.max_batch, self.s.max_wait_ms / 1e3,
                                           on_batch=lambda info, r=route: self._on_batch(r, info),
                                           queued_gauge=self.metrics.queued,
                                           on_dequeue=self.metrics.queue_seconds.observe)
            self.batchers[route].start()
        self.metrics.info.labels(self.s.name, self.s.version, self.s.backend).set(1)
        self.ready = True

    def drain(self) -> None:
        """The batchers stop waiting for more images (:meth:`Batcher.drain`): a drain's queued requests
        are answered at once, not after ``--max-wait-ms``."""
        for b in self.batchers.values():
            b.drain()

    async def stop(self) -> None:
        self.ready = False
        for b in self.batchers.values():
            await b.stop()
        self._decode_pool.shutdown(wait=True)
        self._model_thread.shutdown(wait=True)

    def check_capacity(self) -> None:
        """Raises RequestError 503 at once when no image more fits (before reading a body)."""
        try:
            self.admission.check(1)
        except Overloaded as e:
            raise _overloaded(e) from None

    def _read(self, name: str, data: bytes) -> torch.Tensor:
        """One upload decoded, ``uint8 (3, H, W)`` (EXIF orientation applied).

        Raises:
            RequestError: 413 ``too_many_pixels`` (from the header, before decoding), 400 ``bad_image``.
        """
        try:
            w, h = image_size(data, name)
            if w * h > self.s.max_pixels:
                raise RequestError(413, "too_many_pixels", f"{name} is {w}x{h} pixels, over the limit of "
                                   f"{self.s.max_pixels} pixels (--max-pixels)")
            return decode_image(data, name)
        except CorruptImageError as e:
            if e.reason.startswith("over the decompression-bomb limit"):  # Pillow's own limit, above ours
                raise RequestError(413, "too_many_pixels", str(e)) from None
            raise RequestError(400, "bad_image", str(e)) from None

    def decode(self, name: str, data: bytes) -> torch.Tensor:
        """One image as the model takes it, ``uint8 (3, S, S)`` (in the decoding pool). Raises as :meth:`_read`."""
        return self.predictor.transform(self._read(name, data))

    def decode_viewed(self, name: str, data: bytes) -> tuple[torch.Tensor, tuple[float, float, float, float]]:
        """:meth:`decode` and the box of the upload the model sees (:func:`~vitflow.data.transforms.eval_view`)."""
        image = self._read(name, data)
        return self.predictor.transform(image), eval_view(self.predictor.pp, image.shape[-1], image.shape[-2])

    async def attention(self, name: str, data: bytes, deadline: float) -> tuple[dict, dict]:
        """The attention rollout of one image (:meth:`_attention`) before ``deadline``.

        Returns:
            ``(maps, {"decode_ms", "queue_and_model_ms"})``; ``maps`` as
            :func:`~vitflow.infer.features.attention.attention_maps` with ``"view"``, the box of the
            uploaded image the maps lie over (its pixels, ``(x0, y0, x1, y1)``).
        Raises:
            RequestError: 501 ``not_supported`` (an exported model without its checkpoint, or a model
                without attention maps), 503, 504 and the decoding errors as :meth:`run`.
        """
        if not self.has_torch_model:
            raise RequestError(501, "not_supported", f"/v1/attention needs a PyTorch model; {self.s.name} is an "
                               "exported model: serve its checkpoint")
        loop = asyncio.get_running_loop()
        try:
            with self.admission.admit(1):
                t0 = time.perf_counter()
                pixels, view = await asyncio.wait_for(loop.run_in_executor(self._decode_pool, self.decode_viewed, name,
                                                                           data), max(0.0, deadline - time.monotonic()))
                t1 = time.perf_counter()
                job = loop.run_in_executor(self._model_thread, self._attention, pixels)
                maps = await asyncio.wait_for(job, max(0.0, deadline - time.monotonic()))
        except Overloaded as e:
            raise _overloaded(e) from None
        except asyncio.TimeoutError:
            raise _late(self.s.timeout) from None
        except ValueError as e:  # a model without attention maps
            raise RequestError(501, "not_supported", f"/v1/attention: {e}") from None
        return {**maps, "view": view}, {"decode_ms": round((t1 - t0) * 1e3, 2),
                                        "queue_and_model_ms": round((time.perf_counter() - t1) * 1e3, 2)}

    async def run(self, route: str, upload: Upload, deadline: float) -> tuple[torch.Tensor, BatchInfo, dict]:
        """Decode ``upload``'s images and run them through ``route``'s batcher before ``deadline``.

        Returns:
            ``(rows, the largest batch they ran in, {"decode_ms", "queue_and_model_ms"})``; rows
            are probabilities ``float32 (n, classes)`` (classify) or features ``float32 (n, D)`` (embed).
        Raises:
            RequestError: 503 ``overloaded`` (with ``Retry-After``), 504 ``deadline``, the decoding
                errors of :meth:`decode`, 501 ``not_supported`` (embed on an ONNX model).
        """
        if route == "embed" and not self.has_torch_model:
            raise RequestError(501, "not_supported", f"/v1/embed needs a PyTorch model; {self.s.name} is an exported "
                               "model (it holds only the classifier's logits): serve its checkpoint")
        loop = asyncio.get_running_loop()
        try:
            with self.admission.admit(len(upload.images)):
                t0 = time.perf_counter()
                jobs = [loop.run_in_executor(self._decode_pool, self.decode, n, d) for n, d in upload.images]
                images = await asyncio.wait_for(asyncio.gather(*jobs), max(0.0, deadline - time.monotonic()))
                t1 = time.perf_counter()
                rows, info = await self.batchers[route].submit(torch.stack(images), deadline)
        except Overloaded as e:
            raise _overloaded(e) from None
        except asyncio.TimeoutError:
            raise _late(self.s.timeout) from None
        return rows, info, {"decode_ms": round((t1 - t0) * 1e3, 2),
                            "queue_and_model_ms": round((time.perf_counter() - t1) * 1e3, 2)}


def _features_model(p: Predictor) -> torch.nn.Module | None:
    """The PyTorch model under ``p`` (without TTA) that has ``forward_features``, or None."""
    base = p.model.model if isinstance(p.model, TTAModel) else p.model
    return None if isinstance(base, RuntimeModel) or not hasattr(base, "forward_features") else base


def _late(timeout: float) -> RequestError:
    return RequestError(504, "deadline", f"no answer within the deadline of {timeout:g} s (--timeout); the service "
                        "is busy")


def _overloaded(e: Overloaded) -> RequestError:
    return RequestError(503, "overloaded", f"{e} (the service holds its maximum of images, --max-queue)",
                        {"Retry-After": str(e.retry_after)})
