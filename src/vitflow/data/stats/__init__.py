"""Dataset statistics: per-channel mean and standard deviation of a split measured in one pass,
and its content fingerprint (:mod:`.measure`); where they are kept and ``data.normalize=dataset``
(:mod:`.store`)."""

from vitflow.data.stats.measure import DatasetStats, fmt3, measure, split_fingerprint, stats_from_sums
from vitflow.data.stats.store import SIDECAR, cache_path, dataset_normalization, measure_split

__all__ = ["SIDECAR", "DatasetStats", "cache_path", "dataset_normalization", "fmt3", "measure", "measure_split",
           "split_fingerprint", "stats_from_sums"]
