"""The one way work goes to the ranks: a function and its arguments, pickled together with
cloudpickle and run there by ``entry.call``.

cloudpickle sends functions and classes defined in the notebook (module ``__main__``) by
value, with the module globals they use (``torch``, ``nn``, a helper function), so what works
in ``train`` works the same in ``run``, ``profile``, ``advise``, ``compare``, ``bandwidth`` and
the dask helpers. Functions of importable modules (``axon_nb.rank.entry``, a user's package)
travel by reference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import cloudpickle

from axon_nb.rank import entry


def packed_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    """``fn(*args, **kwargs)`` as bytes that ``entry.call`` runs on a rank. Example::

    view.apply_async(entry.call, packed_call(make_model, (), {}))
    """
    return cloudpickle.dumps((fn, args, kwargs))


def call_args(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Callable[..., Any], bytes]:
    """What to give ``view.apply_async``: ``entry.call`` and the packed call."""
    return entry.call, packed_call(fn, args, kwargs)
