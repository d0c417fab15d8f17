"""Frozen features: :mod:`.embed` (``vitflow embed``), :mod:`.knn` (weighted k-NN classification),
:mod:`.backbone` (a model for feature work from a run, weights or a hub name), and :mod:`.attention`
(where the model looks: per-head attention and rollout)."""
