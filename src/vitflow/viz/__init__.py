"""Visualisation: attention maps and rollout; training curves, learning-rate schedules and run
reports (matplotlib figures, no pyplot: any backend, inline in Jupyter)."""

from vitflow.infer.features.attention import attention_rollout, token_grid
from vitflow.viz.attention import attention_figure, attention_maps, attention_plot, plot_attention

__all__ = ["attention_figure", "attention_maps", "attention_plot", "attention_rollout", "plot_attention", "token_grid"]
