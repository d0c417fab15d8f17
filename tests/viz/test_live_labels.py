"""What the report's panels say they show: the attention maps after the model's pooling, the
accuracy panel's count of evaluations, and the reliability diagram / per-class table."""

from __future__ import annotations

import torch

from vitflow.infer.features.attention import CLASS_TOKEN, PATCH_MEAN, attention_kind, token_grid
from vitflow.models import create_model
from vitflow.viz.classmetrics import calibration_html, prf_table
from vitflow.viz.report import _count_note


def test_attention_label_follows_the_pooling():
    assert attention_kind(create_model("vit_digits_patch2_8", num_classes=3, global_pool="avg")) == PATCH_MEAN
    assert attention_kind(create_model("vit_digits_patch2_8", num_classes=3, global_pool="token")) == CLASS_TOKEN
    rows = torch.tensor([[0.5, 0.25, 0.25], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])  # 1 prefix token, 2 patches
    assert token_grid(rows, 1, (1, 2), CLASS_TOKEN).flatten().tolist() == [1.0, 1.0]  # row 0: 0.25, 0.25
    assert token_grid(rows, 1, (1, 2), PATCH_MEAN).flatten().tolist() == [1.0, 1.0]  # patch rows: 0.5, 0.5 each
    rows[1] = torch.tensor([0.0, 0.9, 0.1])  # patch rows now attend 0.9 + 0.0 to patch 1, 0.1 + 1.0 to patch 2
    assert torch.allclose(token_grid(rows, 1, (1, 2), PATCH_MEAN).flatten(), torch.tensor([0.9 / 1.1, 1.0]))
    assert token_grid(rows, 1, (1, 2), CLASS_TOKEN).flatten().tolist() == [1.0, 1.0]  # the class token's row


def test_panel_texts(tmp_path):
    assert _count_note(1) == "1 evaluation so far" and _count_note(3) == "3 evaluations"
    ev = {"classes": ["a", "b"], "precision": [1.0, 0.5], "recall": [0.5, 1.0], "f1": [2 / 3, 2 / 3],
          "support": [2, 1], "macro_precision": 0.75, "macro_recall": 0.75, "macro_f1": 2 / 3,
          "weighted_precision": 5 / 6, "weighted_recall": 2 / 3, "weighted_f1": 2 / 3, "balanced_accuracy": 0.75,
          "ece": 0.1, "reliability": {"bins": [k / 15 for k in range(16)], "accuracy": [None] * 14 + [2 / 3],
                                      "confidence": [None] * 14 + [0.95], "count": [0] * 14 + [3]}}
    table = prf_table(ev)
    assert "<th>macro average</th><td class=num>75.0%</td>" in table and "Balanced accuracy" in table
    html = calibration_html(ev, tmp_path)
    assert "expected calibration error 0.1000" in html and (tmp_path / "reliability.png").stat().st_size > 5000
