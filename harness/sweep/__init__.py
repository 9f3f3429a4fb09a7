"""Sweeps: plan the points, choose them (grid or Optuna), launch one process per trial."""
