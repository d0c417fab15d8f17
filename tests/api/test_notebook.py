"""The example notebook as committed: executed top to bottom by a real kernel (.ci/notebooks --write),
no cell in error, and its outputs show what it is about: the runs (HTML), the attention maps and the
predictions as figures, the report. (CI executes it again: .ci/run calls .ci/notebooks.)"""

from __future__ import annotations

import json

from helpers import ROOT

NOTEBOOK = ROOT / "examples" / "hymenoptera.ipynb"


def test_the_example_notebook_was_executed_in_order_and_shows_its_figures():
    nb = json.loads(NOTEBOOK.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert [c["execution_count"] for c in code] == list(range(1, len(code) + 1))
    outputs = [o for c in code for o in c["outputs"]]
    assert not [o for o in outputs if o["output_type"] == "error"]
    kinds = [k for o in outputs for k in o.get("data", {})]
    assert kinds.count("image/png") >= 2  # the attention maps and the predictions
    assert kinds.count("text/html") >= 3  # two runs and the report
    assert any("vitflow run" in "".join(o["data"]["text/html"]) for o in outputs if "text/html" in o.get("data", {}))
    text = "".join("".join(o.get("text", "")) for o in outputs)
    assert "largest probability difference, PyTorch vs ONNX Runtime" in text and "val top-1" in text
