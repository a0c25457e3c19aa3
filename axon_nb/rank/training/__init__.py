"""The training loop on a rank, the per-step agreement, and the runs it keeps between calls."""
