"""The harness: one tool for training LLaMA-style models with memory-efficient methods."""

import atexit
import gc
import logging

# A harness process ends holding torch, transformers, pandas and the rest, and the interpreter's
# teardown walks every one of their objects in its last garbage collections: most of a
# sweep's exit time (its fork server pays as much again), before its pipes close. Frozen
# first (the handler runs at exit, before the teardown), they are left to the OS
# as os._exit would leave them, and the rest of a normal exit still happens: every atexit
# handler, and each object freed by its reference count is finalized (files flushed, closed).
atexit.register(gc.freeze)

# transformers imports torchao (methods/adam4bit.py's optimizer) whenever it is installed; on a
# machine without torchao's CUDA kernels that logs a line per kernel library it cannot load,
# and torch one per enum torchao registers: noise on every command's stderr, where a user
# error must be one line.
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
