"""The one way work goes to the ranks: :func:`dispatch`, the only place the kernel hands
ipyparallel a message for the engines (every feature's call through ``Transport.send``,
start-up, the control channel). A function and its arguments are pickled together, once,
with cloudpickle and run there by ``entry.call``.

Once the ranks opened their host relay (at start-up, ``relay.py``), work goes as one message
per host, to the host's lowest target rank, which passes it on to the others; each rank then
publishes its outcome as one message. Before that (start-up itself), work for several ranks
goes as one message through ipyparallel's broadcast scheduler, which copies it to each
engine. Either way each rank answers on its own, under its own message id
(``<id>_<rank or engine>``), so every rank's reply, output, interrupt and abort stay its own
(``waiting.py`` waits on them by rank).

cloudpickle sends functions and classes defined in the notebook (module ``__main__``) by
value, with the module globals they use (``torch``, ``nn``, a helper function), so what works
in ``train`` works the same in ``run``, ``profile``, ``advise``, ``compare``, ``bandwidth`` and
the dask helpers. Functions of importable modules (``axon_nb.rank.entry``, a user's package)
travel by reference.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import cloudpickle
import ipyparallel as ipp
from ipyparallel.client.futures import multi_future

from axon_nb.cluster.relay import relay_of
from axon_nb.rank import entry


def dispatch(client: ipp.Client, targets: list[int], fn: Callable[..., Any], *args: Any
             ) -> ipp.AsyncResult:  # fmt: skip
    """Send ``fn(*args)`` to the engines ``targets`` (their ids are their ranks) without
    waiting: through the host relay once open, else one message copied to each by the
    broadcast scheduler; an ``AsyncResult`` with one message id per target, in ``targets``
    order (one target: its result alone). Example::

        ar = dispatch(client, [0, 1], entry.collectives_issued)
        ar.get(timeout=10)   # [{...}, {...}]
    """
    relay = relay_of(client)
    if relay is not None and relay.covers(targets):
        payload = args[0] if fn is entry.call else packed_call(fn, args, {})
        name = getattr(fn, "__name__", "call")
        return relay.send(targets, "call", payload, name, functools.partial(_forward, client))
    return _direct(client, targets, fn, *args)


def _forward(client: ipp.Client, leaders: list[int], *args: Any) -> ipp.AsyncResult:
    """The relay's one message per host: ``entry.forward`` to the hosts' leaders."""
    return _direct(client, leaders, entry.forward, *args)


def _direct(client: ipp.Client, targets: list[int], fn: Callable[..., Any], *args: Any
            ) -> ipp.AsyncResult:  # fmt: skip
    """ipyparallel's own way: one message per engine, or one copied by the broadcast view."""
    if len(targets) == 1:
        return client[targets[0]].apply_async(fn, *args)
    return _settled(client, _broadcast(client, targets).apply_async(fn, *args))


def dispatch_code(client: ipp.Client, targets: list[int], code: str) -> ipp.AsyncResult:
    """Run ``code`` in the namespaces of the engines ``targets`` (IPython's ``execute``: what
    a ``%%axon`` cell sends), as :func:`dispatch` sends a call. Example::

        ar = dispatch_code(client, [0, 1], "x = rank * 2")
    """
    relay = relay_of(client)
    if relay is not None and relay.covers(targets):
        forward = functools.partial(_forward, client)
        return relay.send(targets, "code", code.encode(), "execute", forward)
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
