"""Visualisation: attention maps and rollout; training curves, learning-rate schedules and run
reports (matplotlib, Agg)."""

from vitflow.viz.attention import attention_figure, attention_rollout, plot_attention, token_grid

__all__ = ["attention_figure", "attention_rollout", "plot_attention", "token_grid"]
