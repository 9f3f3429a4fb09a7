"""What combines with every method: recompute, activation offload, layer-wise updates,
optimizer offload and precision."""
