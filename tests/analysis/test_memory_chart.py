"""The memory chart plots `peak_memory_bytes`, the peak of live tensors on either device, and its
axis says so (it once said "resident set on CPU", which is `peak_rss_bytes`, not plotted)."""

from __future__ import annotations

import pandas as pd

from harness.analysis.plots import memory_chart

GB = 1e9


def trials() -> pd.DataFrame:
    """Two finished trials with known parts: a CPU one, and a CUDA one whose optimizer state
    is on the host. Their RSS is far above their live tensors, as on a CPU it always is."""
    return pd.DataFrame({
        "run_dir": ["runs", "runs"], "trial": ["full-1", "galore-2"],
        "method": ["full", "galore"], "lr": [1e-3, 1e-2], "seed": [0, 0],
        "memory": ["none", "optimizer_offload host"],
        "memory.optimizer_offload": [None, "host"], "device": ["cpu", "cuda:0"],
        "param_bytes": [1 * GB, 1 * GB], "grad_bytes": [1 * GB, 0.5 * GB],
        "optimizer_state_bytes": [2 * GB, 0.25 * GB], "extra_bytes": [0, 0.25 * GB],
        "peak_memory_bytes": [5 * GB, 3 * GB], "peak_rss_bytes": [9 * GB, 9 * GB],
    })  # fmt: skip


def test_bars_add_up_to_the_live_tensor_peak_and_the_axis_says_so() -> None:
    figure, caption = memory_chart(trials(), "demo")
    (ax,) = figure.axes
    label = ax.get_xlabel()
    assert "live tensors" in label and "resident" not in label and "RSS" not in label
    widths = [bar.get_width() for bar in ax.patches]  # segment by segment, both trials each
    segments = [widths[i:i + 2] for i in range(0, len(widths), 2)]
    # parameters, gradients, optimizer state, extras, then the rest of the peak: the CPU
    # trial's 4 GB of parts fill to its 5 GB peak (not its 9 GB RSS); the CUDA trial's
    # host-held states leave its bar, and the rest fills to its 3 GB peak
    assert segments == [[1, 1], [1, 0.5], [2, 0], [0, 0.25], [1, 1.25]]
    assert caption == "Memory breakdown per trial"
