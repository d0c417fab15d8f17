"""Two `vitflow train` on one run folder, started at the same instant, again and again: every time
exactly one runs and the other refuses with one line naming it, and the folder holds exactly one
run's files (issue 40: before the claim both exited 0 and the folder mixed their files).

    python benchmarks/reliability/run_dir_race.py [--races 100] [--json]

Each race starts two processes that import vitflow, report ready, then wait for a start instant
the script hands both (so the two reach `vitflow train` within a millisecond or so of each other),
and train the default preset's small ViT for 2 steps into the same new folder. Checked per race:
exit codes {0, 2}; the refusal names the winner's pid; the folder has one ``start`` and one
``summary`` record, one checkpoint (step 2), its config and mark; nothing else (no lock file, no
staging folder) is left beside it. One line per race; the last line with ``--json``:
``{"races": N, "one_ran_one_refused": N, "holder_named": N, "one_runs_files": N, "seconds": S}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vitflow.rundir import read_metrics

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
RACER = ("import sys, time; from vitflow.cli import main; print('ready', flush=True); "
         "start = float(sys.stdin.readline()); time.sleep(max(0.0, start - time.time())); sys.exit(main(sys.argv[1:]))")


def race(folder: Path) -> dict:
    run = folder / "run"
    cmd = [sys.executable, "-c", RACER, "train", "-q", "train.total_steps=2", "train.log_every=1",
           f"train.run_dir={run}"]
    procs = [subprocess.Popen(cmd, env=ENV, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) for _ in range(2)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    start = time.time() + 0.5
    for p in procs:
        p.stdin.write(f"{start}\n")
        p.stdin.flush()
    outs = [(p.pid, *p.communicate(), p.returncode) for p in procs]
    codes = sorted(rc for *_, rc in outs)
    winner = next((pid for pid, _, _, rc in outs if rc == 0), None)
    refusal = next((err.strip().splitlines()[-1] for _, _, err, rc in outs if rc == 2 and err.strip()), "")
    kinds = [r["kind"] for r in read_metrics(run)] if (run / "metrics.jsonl").is_file() else []
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir()) if (run / "checkpoints").is_dir() else []
    return {"codes": codes, "refusal": refusal,
            "one_ran_one_refused": codes == [0, 2],
            "holder_named": winner is not None and f"is in use by another vitflow run (pid {winner} on host" in refusal,
            "one_runs_files": kinds.count("start") == 1 and kinds.count("summary") == 1
            and checkpoints == ["step-00000002.pt"] and (run / "run.json").is_file() and (run / "config.yaml").is_file()
            and sorted(p.name for p in folder.iterdir()) == ["run"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--races", type=int, default=100)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    t0, totals = time.perf_counter(), {"one_ran_one_refused": 0, "holder_named": 0, "one_runs_files": 0}
    with tempfile.TemporaryDirectory(prefix="vitflow-race-") as tmp:
        for i in range(args.races):
            folder = Path(tmp) / f"race-{i:03d}"
            folder.mkdir()
            r = race(folder)
            for k in totals:
                totals[k] += r[k]
            ok = all(r[k] for k in totals)
            print(f"{'ok  ' if ok else 'FAIL'} race {i:3d}: exits {r['codes']}, {r['refusal'][:110]}", flush=True)
    seconds = round(time.perf_counter() - t0)
    print(f"{args.races} races in {seconds} s: one ran and one refused {totals['one_ran_one_refused']}, holder named "
          f"{totals['holder_named']}, one run's files {totals['one_runs_files']}")
    if args.json:
        print(json.dumps({"races": args.races, **totals, "seconds": seconds}))


if __name__ == "__main__":
    main()
