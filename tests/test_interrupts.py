"""Ctrl-C at any moment leaves the ranks usable: imports and model build included."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any

import pytest

import axon_nb

pytestmark = [pytest.mark.cluster]

_BENCHMARKS = str(Path(__file__).parent.parent / "benchmarks")


def _fuzz() -> Any:
    """``benchmarks/interrupt_fuzz.py``, importable here and on the ranks started after."""
    os.environ["PYTHONPATH"] = os.pathsep.join([_BENCHMARKS, os.environ.get("PYTHONPATH", "")])
    sys.path.insert(0, _BENCHMARKS)
    return importlib.import_module("interrupt_fuzz")


@pytest.mark.timeout(600)
def test_interrupts_at_random_moments_leave_the_ranks_usable() -> None:
    """benchmarks/interrupt_fuzz.py with a smaller count."""
    fuzz = _fuzz()
    # A fresh cluster: its first runs import torch's lazily imported modules, where an
    # interrupt used to leave a module half-imported for good.
    with axon_nb.Cluster(n=2, timeout=60) as cluster:
        assert fuzz.fire(cluster, 12, seed=11) == 12


def test_an_interrupt_inside_an_import_waits_for_it_to_finish() -> None:
    import signal
    import threading
    import time

    from axon_nb.rank.world.interrupts import import_safe_interrupts

    # A module whose import takes a while: the interrupt arrives in the middle of it.
    path = Path(__file__).parent / "_slow_import_probe.py"
    path.write_text("import time\ntime.sleep(0.5)\nDONE = True\n")
    sys.modules.pop("_slow_import_probe", None)
    try:
        threading.Timer(0.2, signal.raise_signal, (signal.SIGINT,)).start()
        with pytest.raises(KeyboardInterrupt), import_safe_interrupts():
            import _slow_import_probe  # noqa: F401

            time.sleep(5)  # the held-back interrupt lands here, once the import is over
        assert sys.modules["_slow_import_probe"].DONE  # complete, not half-initialised
    finally:
        path.unlink()
        sys.modules.pop("_slow_import_probe", None)


@pytest.mark.timeout(600)
def test_ctrl_c_at_random_moments_of_cells_and_training_in_a_kernel() -> None:
    """benchmarks/cell_interrupt_fuzz.py with a smaller count (the benchmark fires 200); each
    trial that leaves a rank unusable prints why."""
    sys.path.insert(0, _BENCHMARKS)
    fuzz = importlib.import_module("cell_interrupt_fuzz")
    assert fuzz.fire(8, seed=3) == 8
