"""Kernel-side dashboards fed by the ranks' metrics stream (never imported on the ranks)."""

from axon_nb.widgets._state import DashboardState

__all__ = ["DashboardState"]
