"""The findings table and the files it becomes.

One row per finding (:data:`COLUMNS`): ``finding`` (a kind of :data:`KINDS`), ``score`` (0..1,
higher is surer or worse; rows are sorted by kind, then score), ``split``, ``key`` (the image's
name in fix files), ``path``, ``label`` (the given class), ``suggested`` (a class, for label
issues), ``other_split`` / ``other_key`` / ``other_path`` (the copy, for duplicates and leaks),
``action`` (what the fix files do with the image: ``exclude``, ``relabel`` or ``review``) and
``detail`` (one line a person reads).

Files: ``findings.csv``, ``findings.json`` (a list of row objects), ``exclude.txt`` (every image
whose action is ``exclude``, by section) and ``relabel.csv`` (``path,label,given,score`` of the
label issues exclude.txt drops: the surest, of the training split): ``vitflow train ... data.exclude=DIR/exclude.txt`` takes them as they are.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

COLUMNS = ["finding", "score", "split", "key", "path", "label", "suggested", "other_split", "other_key",
           "other_path", "action", "detail"]
# kind -> (title on the page, action of its images)
KINDS = {
    "leak": ("Leaks: a copy of a held-out image in another split", "exclude"),
    "label_issue": ("Label issues: the given class is likely wrong", "review"),  # the surest, of train: exclude
    "exact_duplicate": ("Exact copies within a split", "exclude"),
    "near_duplicate": ("Near-copies within a split", "review"),
    "broken": ("Broken files", "exclude"),
    "near_constant": ("Near-constant images (blank, dark, bright)", "review"),
    "tiny": ("Tiny images", "review"),
    "extreme_aspect": ("Extreme aspect ratios", "review"),
    "outlier": ("Outliers: far from every training image", "review"),
    "small_class": ("Classes with too few training images", "review"),
    "imbalance": ("Class imbalance", "review"),
}


def frame(rows: list[dict]):
    """The findings as a pandas DataFrame with :data:`COLUMNS`, sorted by kind then score."""
    import pandas as pd

    df = pd.DataFrame([{c: r.get(c, "") for c in COLUMNS} for r in rows], columns=COLUMNS)
    if len(df):
        order = {k: i for i, k in enumerate(KINDS)}
        df = df.assign(_o=df["finding"].map(order)).sort_values(["_o", "score"], ascending=[True, False],
                                                                kind="stable").drop(columns="_o")
    return df.reset_index(drop=True)


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8", errors="surrogateescape")
    os.replace(tmp, path)


def exclude_lines(df) -> list[str]:
    """``exclude.txt``: the keys whose action is ``exclude``, a ``#`` heading per kind, each key once."""
    lines, seen = [], set()
    for kind, (title, _) in KINDS.items():
        keys = [k for k in df.loc[(df["finding"] == kind) & (df["action"] == "exclude"), "key"] if k not in seen]
        if keys:
            seen.update(keys)
            lines += [f"# {title} ({len(keys)})", *keys, ""]
    return lines


def write_findings(df, out: str | Path, summary: dict) -> dict[str, str]:
    """Write ``findings.csv``, ``findings.json``, ``exclude.txt``, ``relabel.csv`` and ``summary.json``
    into the folder ``out`` (each through a temporary file, so none is ever half written).
    Returns ``{name: path}``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = {n: out / n for n in ("findings.csv", "findings.json", "exclude.txt", "relabel.csv", "summary.json")}
    _atomic(files["findings.csv"], df.to_csv(index=False))
    records = json.loads(df.to_json(orient="records"))
    _atomic(files["findings.json"], json.dumps(records, indent=1, ensure_ascii=False) + "\n")
    header = ["# vitflow inspect: images to drop in every split; delete a line to keep that image.",
              "# Use: vitflow train ... data.exclude=" + str(files["exclude.txt"]), ""]
    _atomic(files["exclude.txt"], "\n".join(header + exclude_lines(df)) + "\n")
    issues = df[(df["finding"] == "label_issue") & (df["action"] == "exclude")]  # the surest, of train
    relabel = issues[["key", "suggested", "label", "score"]].rename(columns={"key": "path", "suggested": "label",
                                                                            "label": "given"})
    _atomic(files["relabel.csv"], relabel.to_csv(index=False))
    _atomic(files["summary.json"], json.dumps(summary, indent=1, default=_plain) + "\n")
    return {k: str(v) for k, v in files.items()}


def _plain(x):
    return x.item() if isinstance(x, np.generic) else str(x)
