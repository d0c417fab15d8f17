"""Visualisation: training curves, learning-rate schedules and run reports (matplotlib, Agg)."""
