"""Checkpoints on the rank side: writing and reading them (tensors and allow-listed metadata
only), the periodic schedule, rescue from survivors."""
