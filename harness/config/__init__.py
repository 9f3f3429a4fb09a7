"""Typed configs loaded from YAML: a run, a sweep, their search spaces and step arithmetic."""

from harness.config.launchers import LauncherConfig
from harness.config.load import parse_overrides, read_yaml, set_dotted, validate
from harness.config.model_options import ModelOptions
from harness.config.run import (
    GLUE_TASKS,
    MODULE_KINDS,
    Common,
    EvalConfig,
    MemoryConfig,
    ModelFrom,
    RunConfig,
    Strict,
    TaskConfig,
    WandbConfig,
    memory_label,
)
from harness.config.sweep import SearchConfig, SweepConfig
from harness.config.train import PRECISION_ALIASES, LossScaleConfig, TrainConfig

__all__ = [
    "GLUE_TASKS", "MODULE_KINDS", "PRECISION_ALIASES", "Common", "EvalConfig", "LauncherConfig",
    "LossScaleConfig", "MemoryConfig", "ModelFrom", "ModelOptions", "RunConfig", "SearchConfig",
    "Strict", "SweepConfig",
    "TaskConfig", "TrainConfig", "WandbConfig", "memory_label", "parse_overrides", "read_yaml",
    "set_dotted", "validate",
]
