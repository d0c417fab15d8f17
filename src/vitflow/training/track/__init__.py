"""What a run records and selects: :mod:`.records` (progress, the metrics files), :mod:`.evaluator`
(the evaluations of a run), :mod:`.selection` (the best checkpoint, early stopping) and
:mod:`.trackers` (MLflow, Weights & Biases)."""
