"""How runs and reports show in Jupyter (``_repr_html_``): the figures as a small table, and the
run report (``vitflow report``'s page) inline, its styles scoped to it so that the notebook's own
are left alone."""

from __future__ import annotations

import html
import re
import sys
from pathlib import Path
from typing import Any

from vitflow.metrics import headline_metrics, task_of

SCOPE = "vitflow-report"


def figures_html(figures: dict[str, dict[str, Any]]) -> str:
    """The headline metrics of each split (``{"val": {...}, "test": {...}}``) as an HTML table."""
    if not figures:
        return ""
    metrics = headline_metrics(task_of(next(iter(figures.values()))))
    metrics = [m for m in metrics if any(f.get(m.name) is not None for f in figures.values())]
    head = "".join(f"<th>{html.escape(m.label)}</th>" for m in metrics)
    rows = "".join(f"<tr><th style='text-align:left'>{html.escape(split)}</th>"
                   + "".join(f"<td>{m.text(f.get(m.name))}</td>" for m in metrics) + "</tr>"
                   for split, f in figures.items())
    return f"<table><tr><th></th>{head}</tr>{rows}</table>"


def scoped_css(css: str, scope: str = SCOPE) -> str:
    """``css`` with every selector inside ``.scope`` (``body`` becomes ``.scope`` itself)."""
    def rule(m: re.Match) -> str:
        selectors = [s.strip() for s in m.group(1).split(",")]
        scoped = [f".{scope}" if s == "body" else f".{scope} {s}" for s in selectors if s]
        return ",".join(scoped) + "{" + m.group(2) + "}"

    return re.sub(r"([^{}]+)\{([^{}]*)\}", rule, css)


class Report:
    """A written run report (``report.html``): ``path``, and shown inline in Jupyter."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def __fspath__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"vitflow report: {self.path}"

    def _repr_html_(self) -> str:
        page = self.path.read_text()
        css = re.search(r"<style>(.*?)</style>", page, flags=re.S)
        body = re.search(r"<body>(.*)</body>", page, flags=re.S)
        style = f"<style>{scoped_css(css.group(1))}</style>" if css else ""
        return f'<div class="{SCOPE}">{style}{body.group(1) if body else page}</div>'


def shown(figure):
    """``figure`` (a matplotlib ``Figure`` made without pyplot), set to show inline when this runs
    in IPython / Jupyter: matplotlib's PNG printer is registered for figures once, as ``%matplotlib
    inline`` would (a figure that pyplot does not manage has no printer until then)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is not None:
        from IPython.core.pylabtools import print_figure
        from matplotlib.figure import Figure

        png = shell.display_formatter.formatters["image/png"]
        try:
            png.lookup_by_type(Figure)
        except KeyError:
            png.for_type(Figure, lambda fig: print_figure(fig, "png", bbox_inches="tight"))
    return figure
