"""The findings as one HTML page a person reads: a section per kind of finding, worst first, each
image a thumbnail with its path, given label, suggestion or copy, and score. Thumbnails are inline
JPEGs (the page is one file that can be mailed or opened offline)."""

from __future__ import annotations

import base64
import html
import io
import os
from pathlib import Path

from vitflow.data.decode import CorruptImageError
from vitflow.data.fixes import image_key
from vitflow.data.sources.base import ImageSource
from vitflow.quality.findings import KINDS

THUMB = 112  # px, the longer side of a thumbnail
PER_KIND = 60  # findings shown per kind (the CSV has them all)

STYLE = """body{font:14px system-ui,sans-serif;margin:24px;color:#222}h1{font-size:22px}h2{font-size:17px;
margin-top:28px}.grid{display:flex;flex-wrap:wrap;gap:10px}.card{width:236px;border:1px solid #ddd;border-radius:6px;
padding:6px}.pics{display:flex;gap:4px;margin-bottom:4px}.card img{width:112px;height:112px;object-fit:contain;
background:#f4f4f4}
.meta{font-size:12px;overflow-wrap:anywhere}.k{color:#777}.score{font-weight:600}table{border-collapse:collapse}
td,th{padding:3px 10px;border-bottom:1px solid #eee;text-align:left}.none{color:#777}"""


def thumbnail(source: ImageSource | None, row: int | None) -> str:
    """A ``data:`` URI of a JPEG thumbnail of image ``row`` (empty when it cannot be read)."""
    if source is None or row is None:
        return ""
    try:
        from PIL import Image

        img = Image.fromarray(source.load(row).permute(1, 2, 0).numpy())
    except (CorruptImageError, OSError, ValueError):
        return ""
    img.thumbnail((THUMB, THUMB))
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=80)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def _card(r: dict, sources: dict, rows: dict) -> str:
    e = html.escape
    img = thumbnail(sources.get(r["split"]), rows.get((r["split"], r["key"])))
    other = thumbnail(sources.get(r["other_split"]), rows.get((r["other_split"], r["other_key"]))) \
        if r["other_key"] else ""
    lines = [f'<span class="score">{r["score"]:.2f}</span> <span class="k">{e(r["split"])}</span>',
             e(r["path"] or ""), f'<span class="k">label</span> {e(r["label"])}']
    if r["suggested"]:
        lines.append(f'<span class="k">suggested</span> {e(r["suggested"])}')
    if r["other_path"]:
        lines.append(f'<span class="k">copy of</span> {e(r["other_split"])}: {e(r["other_path"])}')
    lines.append(f'<span class="k">{e(r["detail"])}</span>')
    pics = "".join(f'<img src="{u}" alt="">' for u in (img, other) if u)
    return f'<div class="card"><div class="pics">{pics}</div><div class="meta">{"<br>".join(lines)}</div></div>'


def render_page(df, summary: dict, sources: dict[str, ImageSource], title: str) -> str:
    """The page's HTML. ``sources``: split -> the source the keys index (for thumbnails)."""
    rows = _rows(df, sources)
    e = html.escape
    head = "".join(f"<tr><th>{e(str(k))}</th><td>{e(_plain(v))}</td></tr>" for k, v in summary.items()
                   if k != "vitflow_inspect")
    parts = [f"<!doctype html><meta charset='utf-8'><title>{e(title)}</title><style>{STYLE}</style>",
             f"<h1>{e(title)}</h1><table>{head}</table>"]
    for kind, (heading, action) in KINDS.items():
        part = df[df["finding"] == kind]
        if not len(part):
            continue
        shown = part.head(PER_KIND)
        dropped = int((part["action"] == "exclude").sum())
        action = action if dropped in (0, len(part)) else f"{dropped} exclude, the rest review"
        parts.append(f"<h2 id='{kind}'>{e(heading)}: {len(part)} <span class='k'>(fix files: {action}"
                     f"{'; the first ' + str(PER_KIND) + ' shown' if len(part) > PER_KIND else ''})</span></h2>")
        parts.append("<div class='grid'>" + "".join(_card(r, sources, rows) for r in shown.to_dict("records"))
                     + "</div>")
    if not len(df):
        parts.append("<p class='none'>No findings.</p>")
    return "\n".join(parts)


def _plain(v) -> str:
    return ", ".join(f"{k}: {x}" for k, x in v.items()) if isinstance(v, dict) else str(v)


def _rows(df, sources: dict[str, ImageSource]) -> dict[tuple[str, str], int]:
    """``(split, key) -> row`` of the images the page shows (and their copies)."""
    wanted = set(zip(df["split"], df["key"])) | set(zip(df["other_split"], df["other_key"]))
    out = {}
    for split, src in sources.items():
        if any(s == split for s, _ in wanted):
            for i in range(len(src)):
                k = image_key(src, i)
                if (split, k) in wanted:
                    out[(split, k)] = i
    return out


def write_page(df, summary: dict, sources: dict[str, ImageSource], out: str | Path, title: str) -> Path:
    """Write ``index.html`` into ``out`` (through a temporary file). Returns its path."""
    path = Path(out) / "index.html"
    tmp = path.with_name(".index.html.tmp")
    tmp.write_text(render_page(df, summary, sources, title), encoding="utf-8", errors="surrogateescape")
    os.replace(tmp, path)
    return path
