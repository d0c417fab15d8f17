"""``vitflow serve --ray``: the service as a Ray Serve application on a local Ray instance that the
test starts on 127.0.0.1 (2 CPUs, no dashboard): two replicas answer as ``vitflow predict``,
and a replica actor killed under load costs error answers, not hangs, and is replaced."""

from __future__ import annotations

import base64
import signal
import time

import httpx
import pytest

from helpers import make_folder
from serve_helpers import Clients, wait_until
from servers import free_port
from vitflow.infer import Predictor, collect_images
from vitflow.infer.serve import ServeSettings
from vitflow.infer.serve.backends import prepare

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")


@pytest.fixture
def local_ray():
    """A local Ray instance in this process; the signal handlers that ``ray.init`` installs (SIGTERM ->
    ``sys.exit(15)``) are put back afterwards, or a later test that signals its own process gets a
    SystemExit instead of vitflow's preemption handling."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def replica_actors() -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith("SERVE_REPLICA::vitflow#"))


@pytest.mark.slow
def test_two_replicas_answer_as_predict_and_a_killed_replica_is_replaced(tiny_run, tmp_path, local_ray):
    from vitflow.infer.serve.ray import deploy

    run, _ = tiny_run
    folder = make_folder(tmp_path / "imgs", classes=("a", "b"), per_class=2)
    refs = collect_images([folder])
    expected = {r["path"]: r["top"] for r in Predictor.load(str(run)).predict_refs(refs, topk=3)}
    settings = prepare(ServeSettings(source=str(run), backend="eager_fp32", port=free_port(), max_batch=4,
                                     max_images=4, timeout=10), tmp_path)
    deploy(settings, replicas=2)
    url = f"http://127.0.0.1:{settings.port}"
    body = {"images": [base64.b64encode(r.read()).decode() for r in refs], "top_k": 3}
    r = httpx.post(url + "/v1/classify", json=body, timeout=30)
    assert r.status_code == 200, r.text
    for pred, ref in zip(r.json()["predictions"], refs):
        assert [t["class"] for t in pred["top"]] == [t["class"] for t in expected[ref.name]]
        for a, b in zip(pred["top"], expected[ref.name]):
            assert a["prob"] == pytest.approx(b["prob"], abs=1e-6 + 1e-9)
    pids = {httpx.get(url + "/readyz", timeout=10).json()["pid"] for _ in range(30)}
    assert len(pids) == 2  # Ray's proxy spreads requests over both replicas
    before = replica_actors()
    assert len(before) == 2

    def replaced_and_running() -> bool:
        now = replica_actors()
        return len(now) == 2 and before[0] not in now and serve.status().applications["vitflow"].status == "RUNNING"

    with Clients(3, lambda: httpx.post(url + "/v1/classify", json=body, timeout=60)) as clients:
        time.sleep(1.0)
        ray.kill(ray.get_actor(before[0], namespace="serve"), no_restart=True)
        replaced = wait_until(replaced_and_running, 180, every=0.2)
    assert replaced is not None, f"the killed replica was not replaced: {replica_actors()}"
    outcomes = clients.statuses()
    assert "hang" not in outcomes and outcomes.count(200) >= 3, outcomes
    assert set(outcomes) <= {200, 500, 502, 503, "connection error"}, outcomes
    assert [httpx.post(url + "/v1/classify", json=body, timeout=30).status_code for _ in range(6)] == [200] * 6
    print(f"replica replaced and serving {replaced:.1f} s after the kill; answers under load: "
          f"{ {o: outcomes.count(o) for o in set(outcomes)} }")
