"""Frozen features: :mod:`.embed` (``vitflow embed``), :mod:`.knn` (weighted k-NN classification) and
:mod:`.backbone` (a model for feature work from a run, weights or a hub name)."""
