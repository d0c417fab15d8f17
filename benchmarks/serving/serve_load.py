"""Load generator for ``vitflow serve`` (127.0.0.1 only; every run bounded in time and requests).

    # one run against a running server: closed loop (N clients, each sends its next request when
    # answered) or open loop (Poisson arrivals at a rate, whatever the answers)
    python benchmarks/serving/serve_load.py run http://127.0.0.1:8000 --images cifar10-jpg.tar --clients 16 --duration 30
    python benchmarks/serving/serve_load.py run http://127.0.0.1:8000 --images cifar10-jpg.tar --rate 200 --duration 60

    # dynamic batching vs --max-batch 1: both servers started here, measured in alternating rounds, each
    # round followed by the model's own batch-16 / batch-1 ratio on the same backend (its ceiling), timed
    # here; the server's share of it, and the dynamic server's mean batch
    python benchmarks/serving/serve_load.py compare RUN_DIR --images cifar10-jpg.tar --clients 16 --duration 20 --rounds 3

    # capacity, 5 minutes at 80% of it (RSS sampled), 3x overload for 60 s, then SIGKILL of a worker and
    # SIGTERM, each under load (benchmarks/serving/serve_soak.py)
    python benchmarks/serving/serve_soak.py RUN_DIR --images cifar10-jpg.tar

Each run prints requests and images answered per second, p50/p95/p99 latency of the 200 answers
(ms, measured by the client from send to the last byte), the answers by status (exceptions by
type: a request is counted once sent and once answered, so none is lost unseen), and the server's
batch-size histogram over the run (the difference of ``/metrics`` before and after).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tarfile
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

LOCAL = {"127.0.0.1", "localhost", "::1"}
IMAGE_EXT = (".jpg", ".jpeg", ".png")


def local_only(url: str) -> str:
    host = urllib.parse.urlparse(url).hostname
    if host not in LOCAL:
        raise SystemExit(f"error: {url}: this load generator only calls 127.0.0.1")
    return url.rstrip("/")


def load_images(path: str, n: int = 256, seed: int = 0) -> list[bytes]:
    """``n`` encoded images from a folder or tar (a seeded sample of its image files)."""
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.suffix.lower() in IMAGE_EXT)
        return [f.read_bytes() for f in random.Random(seed).sample(files, min(n, len(files)))]
    with tarfile.open(p) as tf:
        members = [m for m in tf.getmembers() if m.isfile() and m.name.lower().endswith(IMAGE_EXT)]
        pick = random.Random(seed).sample(members, min(n, len(members)))
        return [tf.extractfile(m).read() for m in pick]


@dataclass
class Result:
    """One run's requests: sent, answers by status (or exception type), latencies of the 200s (s)."""

    sent: int = 0
    statuses: Counter = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> dict:
        lat = sorted(self.latencies)
        pct = {f"p{q}_ms": round(lat[min(len(lat) - 1, int(q / 100 * len(lat)))] * 1e3, 1) if lat else None
               for q in (50, 95, 99)}
        answered = sum(self.statuses.values())
        return {"sent": self.sent, "answered": answered, "lost": self.sent - answered,
                "ok_per_s": round(self.statuses.get(200, 0) / self.seconds, 1), **pct,
                "statuses": {str(k): v for k, v in sorted(self.statuses.items(), key=str)}}


async def _one(session: aiohttp.ClientSession, url: str, data: bytes, result: Result, timeout: float) -> None:
    result.sent += 1
    t0 = time.perf_counter()
    try:
        async with session.post(url, data=data, headers={"Content-Type": "image/jpeg"},
                                timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            await r.read()
            status = r.status
    except asyncio.TimeoutError:
        status = "client timeout"
    except aiohttp.ClientError as e:
        status = type(e).__name__
    if status == 200:
        result.latencies.append(time.perf_counter() - t0)
    result.statuses[status] += 1


async def closed_loop(url: str, images: list[bytes], clients: int, duration: float, max_requests: int = 10**6,
                      timeout: float = 60.0) -> Result:
    """``clients`` concurrent clients, each sending its next image when answered, for ``duration`` s."""
    result, end = Result(), time.monotonic() + duration
    connector = aiohttp.TCPConnector(limit=clients)

    async def client(i: int, session) -> None:
        k = i
        while time.monotonic() < end and result.sent < max_requests:
            await _one(session, url, images[k % len(images)], result, timeout)
            k += clients

    t0 = time.monotonic()
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(client(i, session) for i in range(clients)))
    result.seconds = time.monotonic() - t0
    return result


async def open_loop(url: str, images: list[bytes], rate: float, duration: float, max_requests: int = 10**6,
                    timeout: float = 60.0, seed: int = 0) -> Result:
    """Poisson arrivals at ``rate`` requests/s for ``duration`` s, each sent whatever the others'
    answers (up to ``max_requests``); waits for every answer."""
    rng, result, tasks = random.Random(seed), Result(), []
    connector = aiohttp.TCPConnector(limit=0)
    t0 = time.monotonic()
    async with aiohttp.ClientSession(connector=connector) as session:
        at, k = t0, 0
        while at < t0 + duration and k < max_requests:
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            tasks.append(asyncio.create_task(_one(session, url, images[k % len(images)], result, timeout)))
            k += 1
            at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    result.seconds = time.monotonic() - t0
    return result


def scrape(base: str) -> dict[tuple, float]:
    """The server's ``/metrics`` samples: ``(name, sorted labels) -> value``."""
    import urllib.request

    text = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def batch_histogram(before: dict, after: dict) -> dict[str, int]:
    """Model calls by batch size bucket (``"<=4": n``) between two scrapes."""
    cum = sorted(((float(dict(labels)["le"]), after[k] - before.get(k, 0.0)) for k in after
                  if k[0] == "vitflow_serve_batch_size_bucket" for labels in [k[1]]))
    out, prev = {}, 0.0
    for le, c in cum:
        if c - prev:
            out["inf" if le == float("inf") else f"<={le:g}"] = int(c - prev)
        prev = c
    return out


def served_images(before: dict, after: dict) -> int:
    key = ("vitflow_serve_images_total", (("route", "classify"),))
    return int(after.get(key, 0) - before.get(key, 0))


def measure(base: str, images: list[bytes], clients: int = 0, rate: float = 0.0, duration: float = 20.0,
            max_requests: int = 10**6) -> dict:
    """One bounded run (closed loop with ``clients``, else open loop at ``rate``) with the server's
    batch histogram and its count of images answered over the run."""
    before = scrape(base)
    url = base + "/v1/classify"
    run = closed_loop(url, images, clients, duration, max_requests) if clients else \
        open_loop(url, images, rate, duration, max_requests)
    result = asyncio.run(run)
    after = scrape(base)
    return {**result.summary(), "server_images": served_images(before, after),
            "batches": batch_histogram(before, after), "latencies": result.latencies}


def start_server(source: str, *args: str, port: int, log: Path, ready_s: float = 600.0) -> subprocess.Popen:
    """``python -m vitflow serve SOURCE ARGS --port PORT`` (on 127.0.0.1), once ``/readyz`` answers."""
    import urllib.request

    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "vitflow", "serve", source, "--port", str(port), *args],
                                stdout=f, stderr=subprocess.STDOUT)
    end = time.monotonic() + ready_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"vitflow serve exited with {proc.returncode}: see {log}")
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2).status == 200:
                return proc
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"vitflow serve not ready within {ready_s} s: see {log}")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_flags() -> str:
    flags = set()
    for line in open("/proc/cpuinfo"):
        if line.startswith("flags"):
            flags |= {f for f in line.split() if f.startswith("amx") or f in ("avx512_bf16", "avx2")}
    return f"{os.cpu_count()} cores, flags: {' '.join(sorted(flags)) or '-'}"


def compare(args) -> dict:
    """Dynamic batching (``--max-batch``) vs ``--max-batch 1``, same model, backend, threads and
    client concurrency, in alternating rounds; medians over rounds."""
    images = load_images(args.images, args.n_images)
    common = ["--backend", args.backend, "--threads", str(args.threads), "--max-queue", str(max(64, 4 * args.clients)),
              "--timeout", "120", *args.serve_args]
    servers = {}
    for name, extra in (("dynamic", ["--max-batch", str(args.max_batch), "--max-wait-ms", str(args.max_wait_ms)]),
                        ("batch1", ["--max-batch", "1", "--max-wait-ms", "0"])):
        port = free_port()
        servers[name] = (start_server(args.source, *common, *extra, port=port, log=Path(args.log_dir) / f"{name}.log"),
                         f"http://127.0.0.1:{port}")
    rounds = {name: [] for name in servers}
    clock = ModelClock(args)
    try:
        for name, (_, base) in servers.items():  # warm-up: every batch size the run will see
            measure(base, images, clients=args.clients, duration=3)
        for r in range(args.rounds):
            for name, (_, base) in servers.items():
                m = measure(base, images, clients=args.clients, duration=args.duration)
                rounds[name].append(m)
                print(f"round {r + 1} {name:8s} {m['ok_per_s']:8.1f} img/s  p50 {m['p50_ms']} p95 {m['p95_ms']} "
                      f"p99 {m['p99_ms']} ms  {m['statuses']}  batches {m['batches']}", flush=True)
            own = clock.round()  # the servers idle meanwhile
            print(f"round {r + 1} model    batch 1 {own['model_b1_ms']} ms, batch {args.max_batch} "
                  f"{own['model_batch_ips']} img/s: ratio {own['model_ratio']}", flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(60)
    med = {n: {k: sorted(m[k] for m in ms)[len(ms) // 2] for k in ("ok_per_s", "p50_ms", "p95_ms", "p99_ms")}
           for n, ms in rounds.items()}
    gain = med["dynamic"]["ok_per_s"] / med["batch1"]["ok_per_s"]
    own = clock.summary()
    images_run = sum(m["server_images"] for m in rounds["dynamic"])
    calls = sum(sum(m["batches"].values()) for m in rounds["dynamic"])
    out = {"model": args.source, "clients": args.clients, "max_batch": args.max_batch, "medians": med,
           "mean_batch": round(images_run / max(calls, 1), 2),
           "throughput_ratio": round(gain, 2), "p99_ratio": round(med["dynamic"]["p99_ms"] / med["batch1"]["p99_ms"], 2),
           **own, "server_share_of_model_ratio": round(gain / own["model_ratio"], 2), "cpu": cpu_flags()}
    print(json.dumps(out))
    return out


class ModelClock:
    """The model's own batching ceiling on this machine, the yardstick of the server's gain: the
    same source, backend and threads as the servers (loaded as a serve worker loads it), called
    directly in this process. :meth:`round` times it once (between the servers' runs in
    ``compare``, so that it sees the machine they saw); :meth:`summary` gives the median round."""

    def __init__(self, args):
        import tempfile

        import torch

        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
        from vitflow.infer.serve.backends import load_predictor, prepare
        from vitflow.infer.serve.settings import ServeSettings

        torch.set_num_threads(args.threads)
        with tempfile.TemporaryDirectory() as tmp:
            settings = prepare(ServeSettings(args.source, backend=args.backend, threads=args.threads,
                                             max_batch=args.max_batch), tmp, lambda _: None)
            self.predictor = load_predictor(settings)
        size = self.predictor.pp.image_size
        self.inputs = {b: torch.randint(0, 256, (b, 3, size, size), dtype=torch.uint8) for b in (1, args.max_batch)}
        self.max_batch, self.rounds = args.max_batch, []
        for x in self.inputs.values():
            for _ in range(3):
                self.predictor.predict(x)

    def round(self, seconds: float = 4.0, slices: int = 4) -> dict:
        """Batch 1 and ``--max-batch`` in ``slices`` alternating slices of ``seconds / 2 / slices``
        each (drift of the machine falls on both): the median call's seconds at each size.
        ``{"model_ratio", "model_b1_ms", "model_batch_ips"}`` of this round."""
        calls = {b: [] for b in self.inputs}
        for _ in range(slices):
            for b, x in self.inputs.items():
                end = time.perf_counter() + seconds / 2 / slices
                while time.perf_counter() < end:
                    t0 = time.perf_counter()
                    self.predictor.predict(x)
                    calls[b].append(time.perf_counter() - t0)
        median = {b: sorted(c)[len(c) // 2] for b, c in calls.items()}
        batch_ips = self.max_batch / median[self.max_batch]
        out = {"model_ratio": round(batch_ips * median[1], 2), "model_b1_ms": round(median[1] * 1e3, 2),
               "model_batch_ips": round(batch_ips, 1)}
        self.rounds.append(out)
        return out

    def summary(self) -> dict:
        """The round (of those timed so far) whose ratio is the median: its three figures belong
        together (ratio = batch images/s x batch-1 seconds)."""
        return sorted(self.rounds, key=lambda r: r["model_ratio"])[len(self.rounds) // 2]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run", help="one bounded run against a running server")
    r.add_argument("url")
    mode = r.add_mutually_exclusive_group(required=True)
    mode.add_argument("--clients", type=int, help="closed loop with N clients")
    mode.add_argument("--rate", type=float, help="open loop: Poisson arrivals, requests/s")
    c = sub.add_parser("compare", help="dynamic batching vs --max-batch 1 (both servers started here)")
    c.add_argument("source")
    c.add_argument("--clients", type=int, default=16)
    c.add_argument("--rounds", type=int, default=3)
    c.add_argument("--max-batch", type=int, default=16)
    c.add_argument("--max-wait-ms", type=float, default=5.0)
    c.add_argument("--backend", default="eager_fp32")
    c.add_argument("--threads", type=int, default=os.cpu_count())
    c.add_argument("--log-dir", default=".")
    c.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[], help="more `vitflow serve` options")
    for p in (r, c):
        p.add_argument("--images", required=True, help="image folder or tar (JPEG/PNG files) to send")
        p.add_argument("--n-images", type=int, default=256)
        p.add_argument("--duration", type=float, default=20.0, help="seconds a run lasts (bounded)")
        p.add_argument("--max-requests", type=int, default=10**6)
    args = parser.parse_args(argv)
    print(cpu_flags(), flush=True)
    if args.what == "compare":
        compare(args)
        return 0
    m = measure(local_only(args.url), load_images(args.images, args.n_images), args.clients or 0, args.rate or 0.0,
                args.duration, args.max_requests)
    m.pop("latencies")
    print(json.dumps(m))
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers started here (finally blocks)
    sys.exit(main())
