"""Run a call the kernel packed (``cluster/sending.py``): a function and its arguments,
pickled with cloudpickle so that functions defined in a notebook bring their globals. Both
ways work arrives on a rank run it here: ipyparallel's request (``entry.call``) and the host
relay (``relay.py``).

    run_packed(cloudpickle.dumps((print, ("hello",), {})))
"""

from __future__ import annotations

import pickle
import traceback
from typing import Any

from axon_nb.rank.world.interrupts import import_safe_interrupts


def run_packed(packed: bytes) -> Any:
    """Unpickle ``(fn, args, kwargs)`` (a Ctrl-C meanwhile waits for any import to end) and
    return ``fn(*args, **kwargs)``; a failure's frames are cleared (:func:`forget_locals`)."""
    with import_safe_interrupts():  # (unpickling imports what the call's objects need)
        fn, args, kwargs = pickle.loads(packed)
    try:
        return fn(*args, **kwargs)
    except BaseException as e:
        forget_locals(e)
        raise


def forget_locals(error: BaseException) -> None:
    """Clear the finished frames of ``error``'s traceback (and of the errors it chains). The
    engine keeps the last error until the next one (IPython's ``sys.last_traceback``), and
    its frames would keep what the failed call built alive: a model, its optimizer state,
    the process groups of its layout. The traceback still formats (code and line numbers);
    only the frames' variables go."""
    seen: set[int] = set()
    pending: BaseException | None = error
    while pending is not None and id(pending) not in seen:
        seen.add(id(pending))
        traceback.clear_frames(pending.__traceback__)
        pending = pending.__cause__ or pending.__context__
