"""The sweep's run: the driver, the worker loop a launcher starts, a trial's process and its
state, and what a stop signal or a second sweep on the same folder does."""
