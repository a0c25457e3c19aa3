"""The one way work goes to the ranks: :func:`dispatch`, the only place the kernel hands
ipyparallel a message for the engines (every feature's call through ``Transport.send``,
start-up, the control channel). A function and its arguments are pickled together, once,
with cloudpickle and run there by ``entry.call``.

Work for several ranks goes as one message through ipyparallel's broadcast scheduler, which
copies it to each engine: the kernel sends (and signs) it once, however many ranks there are.
Each engine still answers on its own, under its own message id (``<id>_<engine>``), so every
rank's reply, output, interrupt and abort stay its own (``waiting.py`` waits on them by
rank). One rank is addressed by its id alone, so its result is not wrapped in a list.

cloudpickle sends functions and classes defined in the notebook (module ``__main__``) by
value, with the module globals they use (``torch``, ``nn``, a helper function), so what works
in ``train`` works the same in ``run``, ``profile``, ``advise``, ``compare``, ``bandwidth`` and
the dask helpers. Functions of importable modules (``axon_nb.rank.entry``, a user's package)
travel by reference.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import cloudpickle
import ipyparallel as ipp
from ipyparallel.client.futures import multi_future

from axon_nb.rank import entry


def dispatch(client: ipp.Client, targets: list[int], fn: Callable[..., Any], *args: Any
             ) -> ipp.AsyncResult:  # fmt: skip
    """Send ``fn(*args)`` to the engines ``targets`` (their ids are their ranks) without
    waiting: one message, copied to each by the broadcast scheduler; an ``AsyncResult`` with
    one message id per target, in ``targets`` order. Example::

        ar = dispatch(client, [0, 1], entry.collectives_issued)
        ar.get(timeout=10)   # [{...}, {...}]
    """
    if len(targets) == 1:
        return client[targets[0]].apply_async(fn, *args)
    return _settled(client, _broadcast(client, targets).apply_async(fn, *args))


def dispatch_code(client: ipp.Client, targets: list[int], code: str) -> ipp.AsyncResult:
    """Run ``code`` in the namespaces of the engines ``targets`` (IPython's ``execute``: what
    a ``%%axon`` cell sends), as :func:`dispatch` sends a call. Example::

        ar = dispatch_code(client, [0, 1], "x = rank * 2")
    """
    if len(targets) == 1:
        return client[targets[0]].execute(code, silent=False, block=False)
    view = _broadcast(client, targets)
    return _settled(client, view.execute(code, silent=False, block=False))


_views: weakref.WeakKeyDictionary[ipp.Client, dict[tuple[int, ...], ipp.BroadcastView]] = (
    weakref.WeakKeyDictionary()
)


def _broadcast(client: ipp.Client, targets: list[int]) -> ipp.BroadcastView:
    """The client's broadcast view of ``targets``, made once (a view is costly to make)."""
    views = _views.setdefault(client, {})
    key = tuple(targets)
    if key not in views:
        views[key] = client.broadcast_view(targets=targets)
    return views[key]


def _settled(client: ipp.Client, ar: ipp.AsyncResult) -> ipp.AsyncResult:
    """``ar`` of a broadcast, with the client's books right: ipyparallel (9.0) counts the
    broadcast's own message id as outstanding (for the client and for the last engine) and
    keeps a future for it, and never clears them, as the replies come under the engines' ids
    (``<id>_<engine>``, which it does clear). Left, ``client.outstanding`` would say work is
    running forever after, and every call would leave its future behind."""
    original = {msg_id.rsplit("_", 1)[0] for msg_id in ar.msg_ids}
    for msg_id in original:
        client.outstanding.discard(msg_id)
        for pending in client._outstanding_dict.values():
            pending.discard(msg_id)
        for books in (client._futures, client._output_futures, client.metadata):
            books.pop(msg_id, None)
    for msg_id in ar.msg_ids:  # and the engines' once their replies and output are in
        futures = [client._futures.get(msg_id), client._output_futures.get(msg_id)]
        multi_future([f for f in futures if f is not None]).add_done_callback(
            lambda _, msg_id=msg_id: _forget(client, msg_id)
        )
    return ar


def _forget(client: ipp.Client, msg_id: str) -> None:
    """What ipyparallel forgets of a message it sent itself once it is answered (the
    ``AsyncResult`` keeps what it needs)."""
    for books in (client.results, client._futures, client._output_futures, client.metadata):
        books.pop(msg_id, None)


def packed_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    """``fn(*args, **kwargs)`` as bytes that ``entry.call`` runs on a rank. Example::

    dispatch(client, [0, 1], entry.call, packed_call(make_model, (), {}))
    """
    return cloudpickle.dumps((fn, args, kwargs))


def call_args(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Callable[..., Any], bytes]:
    """What to give :func:`dispatch`: ``entry.call`` and the packed call."""
    return entry.call, packed_call(fn, args, kwargs)
