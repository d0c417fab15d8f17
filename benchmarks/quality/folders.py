"""``vitflow inspect --model`` over many real folders: what it flags on data nobody planted faults
in (the copy rule's false alarms show here), and how long it takes.

    python benchmarks/quality/folders.py --pair FOLDER=RUN [--pair FOLDER=RUN ...] --out /tmp/inspect-folders

The suite's folders (``benchmarks/folders/fetch.py``) with a run trained on each (``plan_suite.py``)
are the usual pairs. One JSON line per folder: images, findings per kind, seconds, and where its
page is; look at the pages' leak and copy sections to judge them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))


def flags() -> str:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return " ".join(sorted({f for f in ("amx_tile", "avx512_bf16", "avx2") if f in text})) or "none"


def main() -> None:
    import vitflow
    from vitflow.infer.features.backbone import load_backbone

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", action="append", required=True, metavar="FOLDER=RUN")
    ap.add_argument("--out", type=Path, default=Path("/tmp/inspect-folders"))
    a = ap.parse_args()
    print(json.dumps({"cpu_flags": flags()}))
    for pair in a.pair:
        folder, run = pair.split("=", 1)
        out = a.out / Path(folder).name
        shutil.rmtree(out, ignore_errors=True)
        checkpoint = load_backbone(run).source  # the checkpoint file: a cold scan, no cache beside the run
        t0 = time.perf_counter()
        df = vitflow.inspect(folder, model=checkpoint, out=out)
        s = df.attrs["summary"]
        print(json.dumps({"folder": folder, "images": sum(s["images"].values()), "splits": s["images"],
                          "findings": s["findings"], "seconds": round(time.perf_counter() - t0, 1),
                          "page": df.attrs["files"]["page"]}), flush=True)


if __name__ == "__main__":
    main()
