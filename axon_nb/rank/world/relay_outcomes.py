"""How relayed parts' outcomes reach the kernel: gathered per host, one message per call.

Each rank of a relayed call (``relay.py``) hands its outcome to the host's leader for that
call, which publishes the outcomes of its host's ranks on its IOPub channel as one message,
once all of them are in, or ``LINGER_S`` after the first one that is waiting (so a rank's
failure is known while its peers still run). A thread of the leader's engine does it, so it
is done while the leader itself runs the call. A rank whose leader has died publishes its
own outcome, alone. The kernel (``cluster/relay.py``) reads every outcome in the message.

    collector = Collector(kernel, "ipc:///tmp/axon-relay-0-x/outcomes")
    collector.expect("a1b2", 4)     # the call's four ranks on this host
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

OUTCOME = "axon_outcome"
"""The IOPub message type of relayed parts' outcomes (the kernel's ``cluster/relay.py``)."""
LINGER_S = 0.05
"""How long an outcome may wait for its host's others before it is published without them."""


Outcome = tuple[dict[str, Any], list[Any]]
"""An outcome: its header (``call``, ``parent``: the part's parent header, ``content``) and
its buffers (the result, serialized)."""


def publish(kernel: Any, rank: int, outcomes: list[Outcome]) -> None:
    """Publish ``outcomes`` as one IOPub message under the kernel's session (the first one's
    parent), its content listing each one's message id, content and number of buffers."""
    listed, buffers = [], []
    for header, own in outcomes:
        listed.append({"msg_id": header["parent"]["msg_id"], "content": header["content"],
                       "buffers": len(own)})  # fmt: skip
        buffers.extend(own)
    parent = outcomes[0][0]["parent"]
    kernel.session.send(
        kernel.iopub_socket,
        OUTCOME,
        {"outcomes": listed},
        parent={"header": parent},
        ident=f"engine.{rank}.{OUTCOME}".encode(),
        buffers=buffers,
        metadata={"engine": kernel.ident},
    )


class Collector:
    """The leader's side: a thread that receives its host's outcomes on ``address`` and
    publishes each call's together (see the module)."""

    def __init__(self, kernel: Any, rank: int, address: str) -> None:
        import zmq

        self.kernel = kernel
        self.rank = rank
        self._expected: dict[str, int] = {}
        self._lock = threading.Lock()
        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PULL)
        self._socket.bind(address)  # (bound before any rank may send to it)
        threading.Thread(target=self._serve, name="axon-relay-outcomes", daemon=True).start()

    def expect(self, call: str, count: int) -> None:
        """``count`` outcomes of ``call`` will come to this leader."""
        with self._lock:
            self._expected[call] = count

    def _serve(self) -> None:
        import zmq

        waiting: dict[str, list[Outcome]] = {}  # by call: outcomes to publish
        counted: dict[str, int] = {}  # by call: outcomes in, those published by their rank too
        since: dict[str, float] = {}  # by call: when its oldest outcome to publish came
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while True:
            timeout = None
            if since:
                left = min(since.values()) + LINGER_S - time.monotonic()
                timeout = max(0, int(left * 1e3) + 1)  # (ms)
            if poller.poll(timeout):
                frames = self._socket.recv_multipart()
                header = json.loads(frames[0])
                call = header["call"]
                counted[call] = counted.get(call, 0) + 1
                if not header.get("published"):
                    waiting.setdefault(call, []).append((header, frames[1:]))
                    since.setdefault(call, time.monotonic())
            for call in list(counted):
                self._settle(call, waiting, counted, since)

    def _settle(self, call: str, waiting: dict[str, list[Outcome]],
                counted: dict[str, int], since: dict[str, float]) -> None:  # fmt: skip
        """Publish ``call``'s waiting outcomes once all its outcomes are in, or once the
        oldest has waited ``LINGER_S``; forget the call once all are in."""
        with self._lock:
            complete = counted[call] >= self._expected.get(call, 1)
            if complete:
                self._expected.pop(call, None)
        late = call in since and time.monotonic() - since[call] >= LINGER_S
        if (complete or late) and waiting.get(call):
            self._publish(waiting.pop(call))
            since.pop(call, None)
        if complete:
            counted.pop(call)
            waiting.pop(call, None)
            since.pop(call, None)

    def _publish(self, outcomes: list[Outcome]) -> None:
        try:
            publish(self.kernel, self.rank, outcomes)
        except Exception as e:  # (the thread must go on for the next calls)
            print(f"axon_nb: could not publish relayed outcomes: {e}", flush=True)
