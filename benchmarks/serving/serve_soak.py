"""What ``vitflow serve`` holds under load, measured on one server started here (127.0.0.1):

1. capacity: closed loop with ``--clients`` clients, ``--capacity-s`` seconds (images/s answered);
2. held load: open loop (Poisson) at 80% of it for ``--minutes``: every request answered 200
   (counted by the client and by the server's ``images_total``), the workers' RSS sampled every
   10 s (flat within 10% after the first minute's warm-up?);
3. overload: 3x the capacity for ``--overload-s``: only 200s and 503s, the ``inflight_images``
   gauge sampled every second (bounded by ``--max-queue`` per worker), no worker lost, and the
   throughput of a closed-loop run right after vs the capacity;
4. SIGKILL of one of the two workers under closed-loop load: answers by kind, client timeouts
   (hangs), the first 200 after the kill, when the replacement worker answers;
5. SIGTERM to the server under open-loop load: answers by kind (200s, and refused connections
   for requests sent after it stopped accepting), its exit status.

    python benchmarks/serving/serve_soak.py RUN_DIR --images /work/shared/data/cifar10-jpg.tar --minutes 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import closed_loop, cpu_flags, free_port, load_images, measure, open_loop, scrape, start_server  # noqa: E402


def workers(parent: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{parent}/task"):
        for pid in Path(f"/proc/{parent}/task/{tid}/children").read_text().split():
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(int(pid))
    return sorted(out)


def rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return round(total / 1024, 1)


class Sampler(threading.Thread):
    """Calls ``fn()`` every ``every`` seconds until stopped; keeps ``(seconds, value)``."""

    def __init__(self, fn, every: float):
        super().__init__(daemon=True)
        self.fn, self.every, self.samples, self.stop = fn, every, [], threading.Event()

    def run(self) -> None:
        t0 = time.monotonic()
        while not self.stop.wait(self.every):
            try:
                self.samples.append((round(time.monotonic() - t0, 1), self.fn()))
            except Exception as e:  # noqa: BLE001 - a sample that fails is recorded as such
                self.samples.append((round(time.monotonic() - t0, 1), repr(e)))

    def finish(self) -> list:
        self.stop.set()
        self.join()
        return self.samples


def held_load(base, proc, images, rate, minutes) -> dict:
    rss = Sampler(lambda: rss_mib([proc.pid, *workers(proc.pid)]), 10.0)
    rss.start()
    m = measure(base, images, rate=rate, duration=minutes * 60)
    series = rss.finish()
    values = [v for t, v in series if t >= 60 and isinstance(v, float)]
    m.pop("latencies")
    return {**m, "rate": rate, "rss_mib": series,
            "rss_spread_after_1min": round((max(values) - min(values)) / values[0], 3) if values else None}


def overload(base, proc, images, rate, seconds, capacity) -> dict:
    gauge = Sampler(lambda: scrape(base).get(("vitflow_serve_inflight_images", ()), -1), 1.0)
    gauge.start()
    m = measure(base, images, rate=rate, duration=seconds)
    inflight = [v for _, v in gauge.finish() if isinstance(v, float)]
    m.pop("latencies")
    after = measure(base, images, clients=16, duration=10)
    after.pop("latencies")
    return {**m, "rate": rate, "inflight_max": max(inflight, default=None), "workers_alive": len(workers(proc.pid)),
            "after": {k: after[k] for k in ("ok_per_s", "p50_ms", "p99_ms", "statuses")},
            "after_vs_capacity": round(after["ok_per_s"] / capacity, 2)}


def _in_thread(coro_fn) -> tuple[threading.Thread, dict]:
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("result", asyncio.run(coro_fn())))
    t.start()
    return t, box


def sigkill(base, proc, images) -> dict:
    import urllib.request

    old = workers(proc.pid)
    t, box = _in_thread(lambda: closed_loop(base + "/v1/classify", images, 16, 20.0, timeout=15.0))
    time.sleep(5)
    killed_at = time.monotonic()
    os.kill(old[0], signal.SIGKILL)
    replaced = None
    while replaced is None and time.monotonic() - killed_at < 120:
        new = set(workers(proc.pid)) - set(old)
        try:
            pid = json.load(urllib.request.urlopen(base + "/readyz", timeout=5))["pid"]
        except OSError:
            pid = None
        if new and pid in new:
            replaced = round(time.monotonic() - killed_at, 1)
        time.sleep(0.1)
    t.join()
    return {**box["result"].summary(), "replacement_worker_answering_after_s": replaced}


def sigterm(base, proc, images, rate) -> dict:
    t, box = _in_thread(lambda: open_loop(base + "/v1/classify", images, rate, 10.0, timeout=60.0))
    time.sleep(5)
    proc.send_signal(signal.SIGTERM)
    t.join()
    return {**box["result"].summary(), "exit_status": proc.wait(120)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source")
    p.add_argument("--images", required=True)
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--overload-s", type=float, default=60.0)
    p.add_argument("--capacity-s", type=float, default=20.0)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--log", default="serve_soak.log")
    p.add_argument("--serve-args", nargs=argparse.REMAINDER, default=["--workers", "2", "--threads", "1"])
    args = p.parse_args(argv)
    print(cpu_flags(), flush=True)
    images = load_images(args.images, 256)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_server(args.source, *args.serve_args, port=port, log=Path(args.log))
    report = {"cpu": cpu_flags(), "serve_args": args.serve_args}
    try:
        measure(base, images, clients=args.clients, duration=5)  # warm-up
        cap = measure(base, images, clients=args.clients, duration=args.capacity_s)
        cap.pop("latencies")
        report["capacity"] = cap
        capacity = cap["ok_per_s"]
        print("capacity", json.dumps(cap), flush=True)
        report["held"] = held_load(base, proc, images, 0.8 * capacity, args.minutes)
        print("held", json.dumps(report["held"]), flush=True)
        report["overload"] = overload(base, proc, images, 3 * capacity, args.overload_s, capacity)
        print("overload", json.dumps(report["overload"]), flush=True)
        report["sigkill"] = sigkill(base, proc, images)
        print("sigkill", json.dumps(report["sigkill"]), flush=True)
        report["sigterm"] = sigterm(base, proc, images, 0.5 * capacity)
        print("sigterm", json.dumps(report["sigterm"]), flush=True)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(60)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers started here (finally blocks)
    sys.exit(main())
