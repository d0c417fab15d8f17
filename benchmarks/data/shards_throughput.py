"""WebDataset shards, local and over HTTP, against the tar read in place: `vitflow bench data`
images/s on the ImageNet sample (1,000 real photos), and the data stall of training
vit_tiny_patch16_224 from the HTTP shards.

    python benchmarks/data/shards_throughput.py [--repeats 5] [--steps 80] [--workers 2]

1. Re-packs ``imagenet-sample-1000.tar`` (a flat folder of ``<wnid>_<name>.JPEG``) into a tar of
   class folders ``imagenet/<wnid>/<file>`` (the JPEG bytes as they are; the tar-in-place path),
   and writes it as shards with ``vitflow prepare TAR OUT --format wds --shard-size N``.
2. Serves the shards with ``tests/servers.py`` (an HTTP/1.1 server with Range requests) in a
   subprocess on 127.0.0.1.
3. Runs one ``vitflow bench data --json`` on the local shards with ``--compare`` the tar and the
   HTTP shards (``http://127.0.0.1:PORT/train-{000000..}.tar``): vitflow's loader (decode,
   random-resized crop, flip, normalise) on the three in each of ``--repeats`` repeats, in
   alternating order; prints the median images/s of each and the ratios local/tar (must be >= 1)
   and HTTP/local (must be >= 0.9) as the median of each repeat's own ratio (a repeat's paths run
   back to back in one process, so a slow spell of a shared machine weighs on them alike), and
   of the medians.
4. Trains vit_tiny_patch16_224 (random weights, 224 px) from the HTTP shards for ``--steps``
   steps and prints the median ``data_stall`` of the logged intervals (the first, with start-up,
   left out; must be < 5%).

All temporary files are removed; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("VITFLOW_SHARED_DATA", ROOT.parent / "shared" / "data"))


def class_tar(src: Path, out: Path, limit: int | None) -> int:
    """The flat ImageNet sample as ``imagenet/<wnid>/<file>`` in the tar ``out``; returns the images."""
    n = 0
    with tarfile.open(src) as tin, tarfile.open(out, "w") as tout:
        for m in tin:
            if not m.isfile() or not m.name.lower().endswith((".jpeg", ".jpg")):
                continue
            base = m.name.rsplit("/", 1)[-1]
            info = tarfile.TarInfo(f"imagenet/{base.split('_', 1)[0]}/{base}")
            info.size = m.size
            tout.addfile(info, tin.extractfile(m))
            n += 1
            if limit and n >= limit:
                break
    return n


def vitflow(*args: str, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-m", "vitflow", *args], env=env, text=True, capture_output=True, **kw)
    if out.returncode:
        sys.exit(f"vitflow {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return out


def bench(path: str, args, *compare: str) -> dict:
    """The JSON result of one `vitflow bench data --json` run on ``path``, ``compare`` timed in
    the same repeats (its table goes to stderr, shown)."""
    out = vitflow("bench", "data", "--data", path, "--json", "--image-size", str(args.image_size), "--workers",
                  str(args.workers), "--repeats", str(args.repeats), "--batch-size", str(args.batch_size),
                  *(["--passes", str(args.passes)] if args.passes else []), *(a for p in compare for a in ("--compare", p)))
    print(out.stderr.strip(), flush=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def serve(folder: Path) -> tuple[subprocess.Popen, str]:
    """tests/servers.py serving ``folder`` in a subprocess: ``(process, base URL)``."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "servers.py"), str(folder)], stdout=subprocess.PIPE,
                            text=True, cwd=str(ROOT / "tests"))
    return proc, proc.stdout.readline().strip()


def stall(data: str, args, run: Path) -> tuple[float, float]:
    """(median data stall, median images/s) of training vit_tiny_patch16_224 from ``data``."""
    from vitflow.config import build_config
    from vitflow.rundir import read_metrics
    from vitflow.training import Trainer

    cfg = build_config("cifar10-vit-tiny", overrides=[
        f"data.path={data}", "data.train_split=train", "data.test_split=none",
        "data.val_split=train-{000000..000000}.tar",  # one shard, evaluated once at the end (a run needs one)
        "model.name=vit_tiny_patch16_224", f"model.img_size={args.image_size}", "data.train_augment=random_resized_crop",
        f"data.num_workers={args.workers}", f"train.batch_size={args.batch_size}", f"train.total_steps={args.steps}",
        f"optim.warmup_steps={max(1, args.steps // 10)}",
        f"train.log_every={args.log_every}", "train.eval_every=0", "train.checkpoint_every=0", f"train.run_dir={run}",
        f"train.device={args.device}", "data.remote_retries=2"])
    Trainer(cfg).fit()
    recs = [r for r in read_metrics(run) if r["kind"] == "train"][1:] or [
        r for r in read_metrics(run) if r["kind"] == "train"]
    return statistics.median(r["data_stall"] for r in recs), statistics.median(r["images_per_s"] for r in recs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tar", default=str(SHARED / "imagenet-sample-1000.tar"))
    ap.add_argument("--limit", type=int, help="use only the first N photos (smoke runs)")
    ap.add_argument("--shard-size", type=int, default=100, help="samples a shard (100: ten shards)")
    ap.add_argument("--repeats", type=int, default=5, help="--repeats of the bench data run (5)")
    ap.add_argument("--passes", type=int, help="--passes of the bench data run (bench data's default: 3)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--image-size", type=int, default=224, help="> 64 (bench data's photo augmentation; at <= 64 px it pads and crops as for CIFAR)")
    ap.add_argument("--steps", type=int, default=80, help="training steps from the HTTP shards (80; 0: skip)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="vitflow-shards-bench-") as tmp:
        tmp = Path(tmp)
        n = class_tar(Path(args.tar), tmp / "imagenet.tar", args.limit)
        vitflow("prepare", str(tmp / "imagenet.tar"), str(tmp / "shards"), "--format", "wds", "--shard-size",
                str(args.shard_size))
        last = len(list((tmp / "shards").glob("train-*.tar"))) - 1
        pattern = f"train-{{000000..{last:06d}}}.tar"
        server, base = serve(tmp / "shards")
        try:
            paths = {"tar": str(tmp / "imagenet.tar"), "local": f"{tmp / 'shards'}/{pattern}",
                     "http": f"{base}/{pattern}"}
            print(f"{n} photos; {last + 1} shards of {args.shard_size}; served at {base}", flush=True)
            r = bench(paths["local"], args, paths["tar"], paths["http"])  # one run: the three in the same repeats
            tar, http = r["compare"][paths["tar"]], r["compare"][paths["http"]]
            print(f"tar in place   {tar['ips']:8.1f} img/s\nlocal shards   {r['vitflow_ips']:8.1f} img/s\n"
                  f"HTTP shards    {http['ips']:8.1f} img/s  (medians of {args.repeats} repeats)")
            print(f"local shards / tar in place: {1 / tar['ratio']:.3f} (must-show >= 1; from the median of the "
                  f"repeats' own ratios; of the medians {r['vitflow_ips'] / tar['ips']:.3f})")
            print(f"HTTP / local shards:         {http['ratio']:.3f} (must-show >= 0.90; median of the repeats' own "
                  f"ratios; of the medians {http['ips'] / r['vitflow_ips']:.3f})", flush=True)
            if args.steps:
                s, tr_ips = stall(paths["http"], args, tmp / "run")
                print(f"training vit_tiny_patch16_224 from HTTP shards, {args.steps} steps: data stall {s:.1%} "
                      f"(median of the logged intervals; must-show < 5%), {tr_ips:.0f} img/s")
        finally:
            server.kill()
            server.wait()


if __name__ == "__main__":
    main()
