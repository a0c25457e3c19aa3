"""Keep an ipyparallel client reading its ranks' IOPub after a message it cannot handle.

ipyparallel's ``Client`` reads IOPub (the ranks' output, their idle statuses, their metrics
publications) in one ZMQ stream callback. When that callback raises, pyzmq re-raises out of
the stream and it never reads again: every later output of the cluster is lost without a
word, and each call then waits out its grace period for an idle status that never comes
(1 s per ``cluster.run``; 10 s per ``train`` before the monitor stopped relying on it).

It happens in ordinary use: a rank opens a widget (``tqdm.auto``, which transformers uses
for "Loading weights", opens one in an engine) while the kernel side is an IPython shell
without a Jupyter kernel (terminal IPython, a script under ``InteractiveShell``): the client
then asks the shell for its ``kernel`` to proxy the widget, and raises ``AttributeError``.
The guard drops that one message (logged) and the stream goes on. It also hands the host
relay's outcomes (``relay.py``) to the relay, which ipyparallel would not know what to do with.

    client = cluster.connect_client_sync()
    guard_iopub(client)
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import ipyparallel as ipp

from axon_nb.cluster.relay import OUTCOME, relay_of

log = logging.getLogger(__name__)

SWAP_WAIT_S = 5.0
"""How long :func:`guard_iopub` waits for the client's IO thread to take the guarded callback."""


def guard_iopub(client: ipp.Client) -> None:
    """Have ``client`` drop an IOPub message its handler raises on, instead of its stream,
    and hand relayed outcomes to its relay."""
    dispatch = client._dispatch_iopub
    dropped = 0
    topic_end = f".{OUTCOME}".encode()

    def on_iopub(parts: list[Any]) -> None:
        nonlocal dropped
        try:
            relay = relay_of(client)
            if relay is not None and parts[0].bytes.endswith(topic_end):
                _, frames = client.session.feed_identities(parts, copy=False)
                relay.outcome(client.session.deserialize(frames, content=True, copy=False))
            else:
                dispatch(parts)
        except Exception:
            # once with its traceback; a widget's updates would repeat it for every message
            dropped += 1
            level = logging.WARNING if dropped == 1 else logging.DEBUG
            log.log(level, "dropped a rank's IOPub message the client could not handle (%d so "
                    "far)", dropped, exc_info=dropped == 1)  # fmt: skip

    swapped = threading.Event()

    def swap() -> None:  # on the client's IO thread, which owns the stream
        client._iopub_stream.on_recv(on_iopub, copy=False)
        swapped.set()

    client._io_loop.add_callback(swap)
    swapped.wait(SWAP_WAIT_S)
