"""Visualisation: attention maps and attention rollout."""

from vitflow.viz.attention import attention_figure, attention_rollout, plot_attention, token_grid

__all__ = ["attention_figure", "attention_rollout", "plot_attention", "token_grid"]
