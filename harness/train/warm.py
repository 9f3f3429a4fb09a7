"""Imported by a process that forks trials or trains many times (the fork server of
harness/sweep/run/starter.py, a test worker): what each trial would otherwise build for itself is
built once here and inherited. transformers' table of checkpoint key conversions is built by
the first `save_pretrained` or `from_pretrained` of a process (about 1,100 entries and 900
regular expressions: a sizeable share of a short forked trial's own CPU, spent again by
every trial as it writes its final model)."""

from transformers.conversion_mapping import get_checkpoint_conversion_mapping

get_checkpoint_conversion_mapping("llama")
