"""Signals both sides agree on."""

from __future__ import annotations

import signal

NATIVE_SIGNAL = signal.SIGUSR1
"""Sent to a rank that does not answer a stack request (holding the GIL in native code):
``faulthandler`` dumps its stacks from C (``rank/observe/watch.py`` registers it)."""
