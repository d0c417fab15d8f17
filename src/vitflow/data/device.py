"""The device end of the pipeline: background prefetch (pinned, non-blocking copies on a side
CUDA stream) and the batched per-step work done on the device (crop/resized crop/flip, normalise,
mix)."""

from __future__ import annotations

import queue
import threading
from typing import Iterable, Iterator

import numpy as np
import torch

from vitflow.data.augment import MixupCutmix, batch_generator, pad_crop_flip, random_resized_crop_flip
from vitflow.data.augment.policies import BatchPolicy
from vitflow.data.transforms import model_input
from vitflow.runtime import mix_seed


class Prefetcher:
    """Iterate ``batches`` in a background thread, keeping up to ``depth`` ready.

    On CUDA each batch's tensors are pinned and copied with ``non_blocking=True`` on a side stream,
    so the copy of batch ``k + 1`` overlaps the compute of batch ``k``; the consumer's stream waits
    on the copy's event. On the CPU the thread only runs the producer ahead (the producer must not
    use the global torch RNG: vitflow's batched path and worker processes do not).
    Exceptions raised by the producer are re-raised in the consumer.
    """

    _END = object()

    def __init__(self, batches: Iterable[dict], device: torch.device, depth: int = 2):
        self.device, self.depth = device, max(1, depth)
        self._it = iter(batches)
        self._queue: queue.Queue = queue.Queue(maxsize=self.depth)
        self._stop = threading.Event()
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._thread = threading.Thread(target=self._run, name="vitflow-prefetch", daemon=True)
        self._thread.start()

    def _to_device(self, batch: dict) -> dict:
        if self._stream is None:
            return batch
        with torch.cuda.stream(self._stream):
            for key in ("images", "labels"):
                batch[key] = batch[key].pin_memory().to(self.device, non_blocking=True)
            batch["ready"] = torch.cuda.Event()
            batch["ready"].record(self._stream)
        return batch

    def _run(self) -> None:
        try:
            for batch in self._it:
                if self._stop.is_set():
                    return
                item = self._to_device(batch)
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
            self._queue.put(self._END)
        except BaseException as e:  # handed to the consumer
            self._queue.put(e)

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        item = self._queue.get()
        if item is self._END:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        if "ready" in item:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(item.pop("ready"))
            for key in ("images", "labels"):
                item[key].record_stream(stream)
        return item

    def close(self) -> None:
        """Stop the producer thread and wait for it (it finishes the batch in hand), so no
        thread is mid-operation when the interpreter exits."""
        self._stop.set()
        while self._thread.is_alive():
            try:  # unblock a producer waiting on a full queue
                self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=0.05)


class DevicePipeline:
    """Turns a ``uint8`` batch into model input on ``device``.

    ``__call__(batch)`` -> ``(x, targets)``: ``x`` float32 ``(B, 3, S, S)`` normalised with
    ``mean`` / ``std``; ``targets`` int64 ``(B,)`` or, with Mixup/CutMix, float32
    ``(B, num_classes)``. An optional batched augmentation runs first on the ``uint8`` batch:
    ``resized_crop = (size, scale, ratio)`` takes one random-resized crop of ``size x size`` per
    image (:func:`~vitflow.data.augment.crops.random_resized_crop_flip` with ``interpolation``, flipped
    when ``hflip``; the batch may have any fixed ``H x W``), else ``crop_padding`` (not ``None``)
    pad-crop-flips it (:func:`~vitflow.data.augment.crops.pad_crop_flip`). Both draw from one generator
    seeded with ``mix_seed(seed, epoch, index, 1)``.
    Setting ``resolution`` (pixels) resizes the batch to ``resolution x resolution``
    (antialiased bilinear) for progressive resizing; ``None`` keeps the loader's size. ``policy``
    (:class:`~vitflow.data.augment.policies.BatchPolicy`: RandAugment / TrivialAugment, random erasing)
    follows the crop, each image seeded from the batch's key and its place in the batch.
    All randomness is seeded from ``(seed, batch["epoch"], batch["index"])``.
    ``host_threads``: on a CPU device, the intra-op threads the batched work may use (``None``:
    torch's setting). The loader sets 1 when worker processes are decoding: the work is
    memory-bound, and a second OpenMP thread (which spin-waits after each op) takes a core from the
    workers — measured here, the consumer's CPU per ImageNet image fell from ~0.45 to ~0.3 ms.
    """

    def __init__(self, device: torch.device, mean, std, seed: int = 0, crop_padding: int | None = None,
                 hflip: bool = False, mix: MixupCutmix | None = None, host_threads: int | None = None,
                 resized_crop: tuple[int, tuple[float, float], tuple[float, float]] | None = None,
                 interpolation: str = "bilinear", policy: BatchPolicy | None = None):
        self.device, self.mean, self.std, self.seed = device, tuple(mean), tuple(std), seed
        self.policy = policy if policy is not None and policy.enabled else None
        self.crop_padding, self.hflip, self.mix = crop_padding, hflip, mix
        self.resized_crop, self.interpolation = resized_crop, interpolation
        self.host_threads = host_threads if device.type == "cpu" else None
        self.resolution: int | None = None

    @property
    def batched_augment(self) -> bool:
        return self.crop_padding is not None or self.resized_crop is not None

    def __call__(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        threads = torch.get_num_threads()
        if self.host_threads is None or self.host_threads == threads:
            return self._finish(batch)
        torch.set_num_threads(self.host_threads)
        try:
            return self._finish(batch)
        finally:
            torch.set_num_threads(threads)

    def _finish(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        images = batch["images"].to(self.device, non_blocking=True)
        y = batch["labels"].to(self.device, non_blocking=True)
        key = (self.seed, batch.get("epoch", 0), batch.get("index", 0))
        if self.resized_crop is not None:
            size, scale, ratio = self.resized_crop
            images = random_resized_crop_flip(images, size, scale, ratio, self.hflip,
                                              batch_generator(self.device, mix_seed(*key, 1)), self.interpolation)
        elif self.crop_padding is not None:
            images = pad_crop_flip(images, self.crop_padding, self.hflip,
                                   batch_generator(self.device, mix_seed(*key, 1)))
        if self.policy is not None:
            first = mix_seed(*key, 3)
            images = self.policy(images, [(first + k) % 2**63 for k in range(len(images))])
        x = model_input(images, self.mean, self.std)
        if self.resolution is not None and self.resolution != x.shape[-1]:
            x = torch.nn.functional.interpolate(x, size=(self.resolution, self.resolution), mode="bilinear",
                                                antialias=True, align_corners=False)
        if self.mix is not None:
            x, y = self.mix(x, y, np.random.default_rng(mix_seed(*key, 2)))
        return x, y
