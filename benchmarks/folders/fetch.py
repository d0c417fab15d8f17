"""Fetch the real image folders of the plan suite (``manifest.json`` beside this script) into one
folder, each checked against the manifest's sha256 before it is used.

    python benchmarks/folders/fetch.py [--out benchmarks/.data/folders] [--mirrors DIR] [--only NAME ...]
                                       [--list]

Each folder of the manifest comes from one commit of a public GitHub repository: the image files
of that commit (from ``--mirrors DIR/OWNER+NAME/repo`` when that clone, bare or not, exists there, else from a
bare clone of ``https://github.com/OWNER/NAME`` under ``OUT/.git``), of which the manifest's
``take`` maps repository folders to split folders (``{"train": "train", "validation": "val"}``) or
to the one folder of class folders (``{"Dataset": ""}``). Only image files are kept (by
extension); ``per_class`` keeps that many files of each class (in ``order``: ``name``, or
``numeric`` for the numbers in the names); a folder without splits is split per class 70 / 15 / 15
into ``train`` / ``val`` / ``test`` by a hash of each file's path (the same split on every machine
and by every version of vitflow). The result is ``OUT/NAME/{train,val,test}/CLASS/FILE``.

The sha256 of a folder is that of its listing: one line ``<sha256 of the file>  <path relative
to the folder>`` per file, in byte order of the paths. A folder already in ``OUT`` whose sha256
matches is kept; one that does not match is never overwritten (move it away first). The shared
tars (CIFAR-10, hymenoptera) are read in place from ``../shared/data`` and listed by ``--list``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MANIFEST = HERE / "manifest.json"
IMAGES = {".jpg", ".jpeg", ".png", ".tif", ".tiff", ".bmp", ".webp"}
SPLIT = (("train", 0.70), ("val", 0.15), ("test", 0.15))


def load_manifest() -> list[dict]:
    return json.loads(MANIFEST.read_text())["folders"]


def listing_sha256(folder: Path) -> str:
    """The sha256 of ``folder``'s listing (see the module docstring)."""
    lines = []
    for path in sorted(folder.rglob("*"), key=lambda p: p.relative_to(folder).as_posix().encode()):
        if path.is_file():
            lines.append(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path.relative_to(folder).as_posix()}\n")
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def _git_dir(repo: str, mirrors: Path | None, out: Path) -> Path:
    local = mirrors / repo.replace("/", "+") / "repo" if mirrors else None
    for git_dir in ([local / ".git", local] if local else []):  # a clone with a work tree, or a bare one
        if (git_dir / "HEAD").is_file() and (git_dir / "objects").is_dir():
            return git_dir
    bare = out / ".git" / repo.replace("/", "+")
    if not bare.exists():
        subprocess.run(["git", "clone", "--bare", "--quiet", f"https://github.com/{repo}", str(bare)], check=True)
    return bare


def _numbers(name: str) -> tuple:
    return tuple(int(x) for x in re.findall(r"\d+", name)) or (0,)


def _members(git_dir: Path, commit: str, take: dict[str, str]) -> dict[tuple[str, str], list[tuple[str, bytes]]]:
    """``{(split folder, class): [(file name, bytes)]}`` of the image files ``CLASS/FILE`` under
    ``take``'s folders at ``commit`` (other files are never read: a snapshot may lack them)."""
    git = ["git", "--git-dir", str(git_dir)]
    listed = subprocess.run([*git, "ls-tree", "-r", "-z", commit, "--", *take], check=True,
                            capture_output=True).stdout.decode().split("\0")
    wanted = []
    for line in filter(None, listed):
        meta, name = line.split("\t", 1)
        path = PurePosixPath(name)
        top = next(t for t in take if name.startswith(t.rstrip("/") + "/"))
        rest = path.relative_to(top).parts
        if meta.split()[1] == "blob" and path.suffix.lower() in IMAGES and len(rest) == 2:
            wanted.append((take[top], rest[0], rest[1], meta.split()[2]))
    blobs = subprocess.run([*git, "cat-file", "--batch"], input="".join(f"{w[3]}\n" for w in wanted).encode(),
                           check=True, capture_output=True).stdout
    out: dict[tuple[str, str], list[tuple[str, bytes]]] = {}
    at = 0
    for split, cls, name, sha in wanted:
        header_end = blobs.index(b"\n", at)
        header = blobs[at:header_end].split()
        if header[-1] == b"missing":
            sys.exit(f"{name}: blob {sha} is missing from {git_dir}")
        size = int(header[2])
        out.setdefault((split, cls), []).append((name, blobs[header_end + 1:header_end + 1 + size]))
        at = header_end + 1 + size + 1
    return out


def build(entry: dict, out: Path, mirrors: Path | None) -> Path:
    """Write folder ``entry`` into ``OUT/NAME`` (through ``NAME.partial``) and check its sha256.

    Raises:
        SystemExit: an existing folder that does not match, or a built one that does not match.
    """
    target = out / entry["name"]
    if target.exists():
        if listing_sha256(target) == entry["sha256"]:
            print(f"{entry['name']}: present, sha256 matches")
            return target
        sys.exit(f"{target}: exists and its sha256 is not the manifest's: move it away, nothing was changed")
    src = entry["source"]
    members = _members(_git_dir(src["repo"], mirrors, out), src["commit"], src["take"])
    partial = out / f"{entry['name']}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    for (split, cls), files in sorted(members.items()):
        files.sort(key=(lambda f: (_numbers(f[0]), f[0])) if src.get("order") == "numeric" else (lambda f: f[0]))
        files = files[:src.get("per_class") or len(files)]
        if split:
            placed = [(split, f) for f in files]
        else:  # no splits in the source: 70 / 15 / 15 per class, by a hash of the path
            ranked = sorted(files, key=lambda f: hashlib.sha256(f"{cls}/{f[0]}".encode()).hexdigest())
            cut1, cut2 = round(len(ranked) * SPLIT[0][1]), round(len(ranked) * (SPLIT[0][1] + SPLIT[1][1]))
            placed = [("train" if i < cut1 else "val" if i < cut2 else "test", f) for i, f in enumerate(ranked)]
        for split_name, (name, data) in placed:
            path = partial / split_name / cls / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
    got = listing_sha256(partial)
    if entry.get("sha256") and got != entry["sha256"]:
        sys.exit(f"{entry['name']}: sha256 {got} is not the manifest's {entry['sha256']}: left in {partial}")
    partial.rename(target)
    print(f"{entry['name']}: {sum(1 for p in target.rglob('*') if p.is_file())} images, sha256 {got}")
    return target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / ".data" / "folders"))
    ap.add_argument("--mirrors", help="a folder of clones OWNER+NAME/repo to read instead of GitHub")
    ap.add_argument("--only", nargs="*", help="these folders only")
    ap.add_argument("--list", action="store_true", help="print the manifest's folders and exit")
    args = ap.parse_args()
    entries = [e for e in load_manifest() if not args.only or e["name"] in args.only]
    if args.list:
        for e in entries:
            print(f"{e['name']:22s} {e['kind']:40s} {e['images']:6d} images {e['classes']:3d} classes "
                  f"{e['median_size']:>9s}  {e['licence']}")
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for entry in entries:
        if "source" in entry:
            build(entry, out, Path(args.mirrors) if args.mirrors else None)


if __name__ == "__main__":
    main()
