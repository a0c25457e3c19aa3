"""What a rank publishes of a long call's progress (``evaluate``, ``predict``), for the
kernel's bar: ``publish_data({PROGRESS_KEY: (done, total, loss_or_None)})``."""

from __future__ import annotations

PROGRESS_KEY = "axon_progress"
"""The key of a rank's published ``(done, total, loss)``."""
