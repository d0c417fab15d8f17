"""Dynamic batching: requests that arrive together are answered by one model call.

Each image of a request becomes one item in an asyncio queue. A single loop per
:class:`Batcher` takes the first waiting item, then more until ``max_batch`` items or until the
first one has waited ``max_wait`` seconds (Triton's ``max_queue_delay``; items already waiting
are taken at once), stacks them, runs the model on its own thread (the event loop keeps
accepting and decoding meanwhile) and hands each item its row. While the model runs, the next
batch gathers: under load batches fill up by themselves; at low load an image waits at most
``max_wait``.

:class:`Admission` bounds the images in the service (decoding, queued or in the model): past
``limit`` a request is refused at once (``503`` with ``Retry-After``) instead of queueing
without bound. Each item carries its request's deadline: an item whose request is past its
deadline (or whose caller gave up) is dropped before the model call, never run.
"""

from __future__ import annotations

import asyncio
import math
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

_FLUSH: Any = object()  # queued by Batcher.drain: run what is gathered now


class Overloaded(Exception):
    """The service holds its maximum of images; ``retry_after`` (whole seconds, >= 1) is an
    estimate of when it will have room."""

    def __init__(self, retry_after: int):
        super().__init__(f"over capacity: retry after {retry_after} s")
        self.retry_after = retry_after


@dataclass
class _Item:
    image: torch.Tensor  # uint8 (3, S, S)
    deadline: float  # time.monotonic() seconds
    future: asyncio.Future
    admitted: float = field(default_factory=time.monotonic)


@dataclass
class BatchInfo:
    """What one model call was: its images and how long it ran (seconds)."""

    size: int
    model_s: float


class Admission:
    """Counts images admitted and not yet answered; refuses past ``limit`` (``--max-queue``).

    ``rate``: a callable giving the recent model throughput (images/s) for ``Retry-After``.
    """

    def __init__(self, limit: int, rate: Callable[[], float], gauge=None):
        self.limit, self.rate, self.gauge, self.inflight = limit, rate, gauge, 0

    def retry_after(self) -> int:
        """Seconds until the images held now are answered at the recent rate, 1..60."""
        return int(min(60, max(1, math.ceil(self.inflight / max(self.rate(), 1e-3)))))

    def check(self, n: int = 1) -> None:
        """Raises :class:`Overloaded` when ``n`` more images would not fit."""
        if self.inflight + n > self.limit:
            raise Overloaded(self.retry_after())

    def admit(self, n: int) -> "_Admitted":
        """``with admission.admit(n):`` holds ``n`` images for the block; raises :class:`Overloaded`."""
        self.check(n)
        return _Admitted(self, n)

    def _add(self, n: int) -> None:
        self.inflight += n
        if self.gauge is not None:
            self.gauge.set(self.inflight)


class _Admitted:
    def __init__(self, admission: Admission, n: int):
        self.admission, self.n = admission, n
        admission._add(n)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.admission._add(-self.n)


class Batcher:
    """Gathers images into batches for ``run`` (``uint8 (B, 3, S, S)`` -> a tensor of ``B`` rows),
    called on ``executor`` (one thread: the model's).

    Args:
        max_batch: images per call, at most.
        max_wait: seconds the first image of a batch waits for more.
        on_batch: called after each call with its :class:`BatchInfo` (metrics).
        queued_gauge: a Prometheus gauge set to the images waiting for a model call (queued, or gathered
            for the next batch), or None.
        on_dequeue: called with each image's wait in the queue (seconds) as its batch starts.
    """

    def __init__(self, run: Callable[[torch.Tensor], torch.Tensor], executor: Executor, max_batch: int,
                 max_wait: float, on_batch: Callable[[BatchInfo], None] | None = None, queued_gauge: Any = None,
                 on_dequeue: Callable[[float], None] | None = None):
        self.run, self.executor, self.max_batch, self.max_wait = run, executor, max_batch, max_wait
        self.on_batch, self.queued_gauge, self.on_dequeue = on_batch, queued_gauge, on_dequeue
        self.images_per_s = 0.0  # moving average of the model's throughput (Retry-After)
        self._queue: asyncio.Queue[_Item | None] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._waiting = 0  # images submitted and not yet in a model call (queued, or gathered for the next batch)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    def drain(self) -> None:
        """Stop waiting for more images (a drain: SIGTERM): what is gathered runs now, and every
        later batch as soon as its first image is queued (``max_wait`` becomes 0)."""
        self.max_wait = 0.0
        self._queue.put_nowait(_FLUSH)

    async def stop(self) -> None:
        """Answer what is queued, then end the loop."""
        if self._task is not None:
            self._queue.put_nowait(None)
            await self._task
            self._task = None

    async def submit(self, images: torch.Tensor, deadline: float) -> tuple[torch.Tensor, BatchInfo]:
        """Run ``images`` (``uint8 (n, 3, S, S)``) in the next batches; returns their output rows
        (``(n, ...)``, in order) and the largest batch they ran in.

        Raises:
            asyncio.TimeoutError: ``deadline`` (``time.monotonic()`` seconds) passed first; the
                images not yet run are dropped.
            Exception: whatever the model raised.
        """
        loop = asyncio.get_running_loop()
        items = [_Item(img, deadline, loop.create_future()) for img in images]
        for item in items:
            self._queue.put_nowait(item)
        self._waiting += len(items)
        self._gauge()
        gathered = asyncio.gather(*(i.future for i in items))
        done = await asyncio.wait_for(gathered, max(0.0, deadline - time.monotonic()))
        return torch.stack([row for row, _ in done]), max((info for _, info in done), key=lambda i: i.size)

    def _gauge(self) -> None:
        if self.queued_gauge is not None:
            self.queued_gauge.set(self._waiting)

    async def _next_batch(self) -> list[_Item] | None:
        """The next batch of live items (None: stop); every item taken from the queue leaves the
        waiting count, live or not."""
        first = await self._queue.get()
        if first is None:
            return None
        if first is _FLUSH:
            return []
        batch, until = [first], first.admitted + self.max_wait
        while len(batch) < self.max_batch:
            try:
                item = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                wait = until - time.monotonic()
                if wait <= 0:
                    break
                try:
                    item = await asyncio.wait_for(self._queue.get(), wait)
                except asyncio.TimeoutError:
                    break
            if item is None:  # stop after this batch
                self._queue.put_nowait(None)
                break
            if item is _FLUSH:  # draining: no more waiting
                break
            batch.append(item)
        now = time.monotonic()
        self._waiting -= len(batch)
        return [i for i in batch if not i.future.done() and i.deadline > now]

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while (batch := await self._next_batch()) is not None:
            self._gauge()
            if not batch:
                continue
            if self.on_dequeue is not None:
                now = time.monotonic()
                for item in batch:
                    self.on_dequeue(now - item.admitted)
            t0 = time.perf_counter()
            try:
                out = await loop.run_in_executor(self.executor, self.run, torch.stack([i.image for i in batch]))
            except Exception as e:  # noqa: BLE001 - every waiting request gets the model's error
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(e)
                continue
            info = BatchInfo(len(batch), time.perf_counter() - t0)
            rate = info.size / max(info.model_s, 1e-6)
            self.images_per_s = rate if not self.images_per_s else 0.8 * self.images_per_s + 0.2 * rate
            if self.on_batch is not None:
                self.on_batch(info)
            for item, row in zip(batch, out):
                if not item.future.done():
                    item.future.set_result((row, info))
