"""The service fuzzed from its own OpenAPI schema: Schemathesis against ``vitflow serve`` with keys.

    python benchmarks/serving/schema_fuzz.py RUN [--max-examples 400] [--seed 1]

Starts ``vitflow serve RUN --api-key-file KEYS --auth-failures 0`` on 127.0.0.1, runs ``schemathesis
run URL/openapi.json --checks all`` (but ``positive_data_acceptance``: no schema can say "a
decodable image") with the key, its coverage and fuzzing phases (the stateful phase has no links
to follow in this API), and prints one JSON line: requests generated, Schemathesis' failures, the
service's answers by status (from its own ``/metrics``: 5xx counted), whether the server is still
up, and its workers' RSS before and after (KiB) with the growth; then the CPU flags.
"""

from __future__ import annotations

import argparse
import json
import re
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from serve_load import cpu_flags  # noqa: E402

from serve_helpers import Served  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="a run folder or checkpoint to serve")
    ap.add_argument("--max-examples", type=int, default=400, help="Schemathesis' examples per operation and phase")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    key = secrets.token_urlsafe(24)
    with tempfile.TemporaryDirectory(prefix="vitflow-fuzz-") as tmp:
        keys = Path(tmp) / "keys.txt"
        keys.write_text(key + "\n")
        s = Served(a.run, "--api-key-file", str(keys), "--auth-failures", "0", log=Path(tmp) / "serve.log")
        try:
            before = s.rss_kib()
            cmd = [str(Path(sys.executable).with_name("schemathesis")), "run", s.url + "/openapi.json", "--checks",
                   "all", "--exclude-checks", "positive_data_acceptance", "-H", f"Authorization: Bearer {key}",
                   "--max-examples", str(a.max_examples), "--seed", str(a.seed), "--request-timeout", "60",
                   "--no-color"]
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)  # its .schemathesis/ files go there
            text = out.stdout + out.stderr
            metrics = httpx.get(s.url + "/metrics", headers={"X-API-Key": key}).text
            by_status: dict[str, int] = {}
            for f in text_string_to_metric_families(metrics):
                if f.name == "vitflow_serve_requests":
                    for smp in f.samples:
                        if smp.name.endswith("_total"):
                            by_status[smp.labels["status"]] = by_status.get(smp.labels["status"], 0) + int(smp.value)
            after = s.rss_kib()
            up = s.proc.poll() is None
        finally:
            code = s.stop()
            log = s.log.read_text()
    found = re.search(r"(\d+) generated", text)
    print(json.dumps({"schemathesis_exit": out.returncode, "generated": int(found.group(1)) if found else None,
                      "failures_line": next((ln.strip() for ln in text.splitlines() if "generated" in ln), ""),
                      "answers_by_status": dict(sorted(by_status.items())),
                      "server_5xx": sum(n for st, n in by_status.items() if st.startswith("5")),
                      "server_up_after": up, "server_exit": code, "tracebacks_in_log": log.count("Traceback"),
                      "rss_kib_before": before, "rss_kib_after": after,
                      "rss_growth": round(after / before - 1, 4) if before else None,
                      "cpu": cpu_flags()}))
    if out.returncode:
        print(text[-6000:], file=sys.stderr)


if __name__ == "__main__":
    main()
