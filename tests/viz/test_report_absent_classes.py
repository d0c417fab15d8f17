"""The report's per-class table (``vitflow.viz.classmetrics.prf_table``) for a split that has no
image of some of the run's classes: their rows are left out, the table names them, and the macro
row is the mean over the classes present (sklearn's ``precision_recall_fscore_support`` with
``labels=`` those)."""

from __future__ import annotations

import re

import numpy as np
from sklearn.metrics import confusion_matrix, precision_recall_fscore_support

from vitflow.metrics.classification import confusion_metrics
from vitflow.viz.classmetrics import prf_table


def test_the_report_table_leaves_out_and_names_the_classes_a_split_lacks():
    rng = np.random.default_rng(1)
    y = rng.choice([0, 1, 3], size=90)  # class 2 has no image in this split...
    pred = np.where(rng.random(90) < 0.6, y, rng.choice(4, size=90))
    assert 2 in pred and 2 not in y  # ...but the model predicts it
    classes = ["ants", "bees", "wasps", "moths"]
    ev = {**confusion_metrics(confusion_matrix(y, pred, labels=range(4))), "classes": classes}
    table = prf_table(ev)
    assert re.findall(r"<tr><td>([^<]*)</td>", table) == ["ants", "bees", "moths"]
    assert "absent from this split, left out of the table and the macro averages: wasps" in table
    p, r, f, _ = precision_recall_fscore_support(y, pred, labels=[0, 1, 3], average="macro", zero_division=0)
    assert (f"<tr><th>macro average</th><td class=num>{p:.1%}</td><td class=num>{r:.1%}</td>"
            f"<td class=num>{f:.1%}</td><td class=num>90</td></tr>") in table
