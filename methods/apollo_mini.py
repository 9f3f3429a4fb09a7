"""APOLLO-Mini (Zhu et al., 2024): APOLLO at rank 1 with one scaling factor per matrix, so
each targeted m×n weight keeps 2·max(m, n) moment values and one norm: SGD's memory. Its own
registry entry, because rank and granularity are what define it (they are not settings)."""

from __future__ import annotations

from harness.config.tuning import tunable
from harness.methods.apollo import APOLLO, APOLLOCommon
from harness.methods.base import register


class APOLLOMiniConfig(APOLLOCommon):
    scale: float = tunable(128.0, values=[32.0, 64.0, 128.0, 256.0], gt=0,
                           description="the update is multiplied by √scale (α²)",
                           source="around APOLLO-Mini's α² 128, arXiv 2412.05270")

    def projection(self) -> tuple[int, str]:
        return 1, "tensor"


@register("apollo_mini")
class APOLLOMini(APOLLO):
    summary = "APOLLO-Mini: rank-1 random projection, one scaling factor per matrix"
    Config = APOLLOMiniConfig
