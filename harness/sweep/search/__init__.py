"""The sweep's search: where its trials come from (a grid, or Optuna studies with their storage,
pruners and objectives), behind one `Search`/`Source` interface (source.py)."""
