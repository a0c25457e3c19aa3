"""The kernel's side of the host relay: work for several ranks as one message per host, and
each rank's outcome as one message (the ranks' side, and why: ``rank/world/relay.py``).

``sending.dispatch`` sends through the relay once the ranks opened it at start-up
(:func:`register`). The kernel makes for each target rank the futures ipyparallel makes for
a request of its own (its message id ``<id>_<rank>``, counted as outstanding on the rank's
engine), so that everything that waits on ranks sees an ordinary ``AsyncResult``: streamed
output, displays, ``abort`` (the rank skips a part it has not started), and a rank's death
(ipyparallel fails the outstanding messages of an engine that unregisters). What ipyparallel
does on a reply, :meth:`Relay.outcome` does on an outcome, on the client's IO thread
(``iopub_guard`` hands it the outcomes, one message per host and call).

    register(client, {0: ("vm", "/tmp/axon-relay-0-x"), 1: ...})
    ar = relayed(client, [0, 1], "call", packed)   # an ipyparallel AsyncResult
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import uuid
import weakref
from collections.abc import Callable
from typing import Any

import ipyparallel as ipp
from ipyparallel import error as ipp_error
from ipyparallel import util as ipp_util
from ipyparallel.client.client import ExecuteReply
from ipyparallel.client.futures import MessageFuture, multi_future
from ipyparallel.serialize import deserialize_object

OUTCOME = "axon_outcome"
"""The IOPub message type of a relayed part's outcome (as ``rank/world/relay.py`` sends it)."""

Plan = dict[int, list[tuple[int, str, str, int]]]
"""Each host leader's ranks: ``(rank, relay directory, message id, seq)`` (``seq``: the part's
number among those this relay sent the rank, which the ranks run in order:
``rank/world/relay_order.py``)."""
Forward = Callable[[list[int], dict[str, Any], bytes, Plan], ipp.AsyncResult]
"""How the relay sends ``entry.forward`` to the host leaders (``sending``'s direct path)."""


class Relay:
    """One client's relay: each rank's host and relay directory (``routes``)."""

    def __init__(self, client: ipp.Client, routes: dict[int, tuple[str, str]]) -> None:
        self.client = client
        self.routes = routes
        self._acks: dict[str, concurrent.futures.Future[None]] = {}
        """Each waiting part's leader's answer (resolved when in)."""
        self.outcome_messages = 0
        """How many messages of outcomes the kernel read (about one per host and call)."""
        self.epoch = uuid.uuid4().hex
        """This relay's name on the ranks, under which they count its parts."""
        self._sent: dict[str, int] = {}
        """How many parts went to each rank (by its relay directory: a new engine starts at 1)."""

    def covers(self, targets: list[int]) -> bool:
        return all(t in self.routes for t in targets)

    def send(self, targets: list[int], kind: str, payload: bytes, fname: str, forward: Forward
             ) -> ipp.AsyncResult:  # fmt: skip
        """``payload`` (a packed call, or a cell's code) to ``targets``: one message to each
        host's leader (``_leader``), which passes it on; an ``AsyncResult`` with one message
        per target (one target: its result alone, not in a list)."""
        base = uuid.uuid4().hex
        ids = {r: f"{base}_{r}" for r in targets}
        futures = [self._expect(ids[r], r, kind) for r in targets]
        hosts: dict[str, list[int]] = {}
        for r in targets:
            hosts.setdefault(self.routes[r][0], []).append(r)
        plan = {self._leader(rs): [(r, self.routes[r][1], ids[r], self._number(r)) for r in rs]
                for rs in hosts.values()}  # fmt: skip
        leaders = sorted(plan)
        forwarded: dict[int, concurrent.futures.Future[None]] = {
            leader: concurrent.futures.Future() for leader in leaders
        }
        for leader in leaders:  # (before sending: an outcome may come back at once)
            self._acks.update({msg_id: forwarded[leader] for _, _, msg_id, _ in plan[leader]})
        try:
            acks = forward(leaders, {"kind": kind, "call": base, "epoch": self.epoch}, payload,
                           plan)  # fmt: skip
        except BaseException as e:  # (nothing went: nothing may stay counted as running)
            for done in forwarded.values():
                done.set_result(None)
            for msg_id in ids.values():
                self._settle(msg_id, e)
            for r in targets:  # (their numbers go to the next parts)
                self._sent[self.routes[r][1]] -= 1
            raise
        for leader, ack in zip(leaders, acks.split(), strict=True):
            there = {leader: plan[leader]}
            ack.add_done_callback(lambda a, f=forwarded[leader], p=there:
                                  self._forwarded(a, f, p, forward))  # fmt: skip
        if len(targets) == 1:
            return ipp.AsyncResult(self.client, futures[0], fname=fname, targets=targets[0])
        return ipp.AsyncResult(self.client, futures, fname=fname, targets=targets)

    def _expect(self, msg_id: str, rank: int, kind: str) -> MessageFuture:
        """ipyparallel's books for a request to ``rank``, as if it had sent it itself."""
        client = self.client
        header = {"msg_id": msg_id, "msg_type": f"{kind}_request", "date": ipp_util.utcnow()}
        future, output = client.create_message_futures(msg_id, header, async_result=True)
        engine = client._engines[rank]
        metadata = client.metadata[msg_id]
        metadata.update(engine_id=rank, engine_uuid=engine, kind=kind)
        client.outstanding.add(msg_id)
        client._outstanding_dict[engine].add(msg_id)  # a death fails it (ipyparallel's books)
        # (both: ipyparallel resolves a dead engine's output before its result, which it then
        # reads from ``client.results``)
        multi_future([future, output]).add_done_callback(lambda _: self._forget(msg_id))
        return future

    def outcome(self, msg: dict[str, Any]) -> None:
        """(The client's IO thread) ranks' outcomes: resolve their parts as replies would."""
        self.outcome_messages += 1
        buffers = list(msg["buffers"])
        for listed in msg["content"]["outcomes"]:
            mine, buffers = buffers[: listed["buffers"]], buffers[listed["buffers"] :]
            msg_id = listed["msg_id"]
            metadata = self.client.metadata.get(msg_id)
            if metadata is None or msg_id not in self.client._futures:
                continue  # (not this client's, or already settled: a death came first)
            content = listed["content"]
            try:
                result = self._result(msg_id, content, mine, metadata)
            except Exception as e:  # (a result that does not unpickle here) the part fails so
                result = e
            metadata.update(completed=ipp_util.utcnow(), status=content["status"])
            self._settle(msg_id, result)

    def _result(self, msg_id: str, content: dict[str, Any], buffers: list[Any],
                metadata: dict[str, Any]) -> Any:  # fmt: skip
        if content["status"] == "ok" and metadata["kind"] == "code":
            return ExecuteReply(msg_id, content, metadata)
        if content["status"] == "ok":
            return deserialize_object(buffers)[0] if buffers else None
        if content["status"] == "aborted":
            return ipp_error.TaskAborted(msg_id)
        return self.client._unwrap_exception(content)

    def _leader(self, ranks: list[int]) -> int:
        """A host's leader for a call: its lowest target rank with no work of this client
        outstanding (so that the call's parts there, which the other ranks run in order, do
        not wait for a busy rank to pass them on), else its lowest."""
        outstanding = self.client._outstanding_dict
        idle = [r for r in ranks if not outstanding.get(self.client._engines.get(r, ""), ())]
        return min(idle or ranks)

    def _number(self, rank: int) -> int:
        directory = self.routes[rank][1]
        self._sent[directory] = self._sent.get(directory, 0) + 1
        return self._sent[directory]

    def _forwarded(self, ack: ipp.AsyncResult, forwarded: concurrent.futures.Future[None],
                   plan: Plan, forward: Forward) -> None:  # fmt: skip
        """A leader's answer is in: its host's parts' output is complete once theirs are in
        too (so no call ends with its message still counted as outstanding); if it failed to
        pass the work on (it died, or raised), the parts fail so, and their ranks are told
        not to wait for them."""
        if not ack.successful():
            for parts in plan.values():
                for _, _, msg_id, _ in parts:
                    if msg_id in self.client._futures:
                        self._settle(msg_id, ack.exception())
            self._skip(plan, forward)
        forwarded.set_result(None)

    def _skip(self, plan: Plan, forward: Forward) -> None:
        """Tell each live rank of ``plan`` (through its own engine) that its parts there will
        not come, so that it does not hold the parts after them (``relay_order.py``)."""
        alive = set(self.client.ids)
        for parts in plan.values():
            for rank, directory, _, seq in parts:
                if rank not in alive:
                    continue
                header = {"kind": "skip", "call": "", "epoch": self.epoch, "skip": [seq]}
                with contextlib.suppress(Exception):  # (it died meanwhile: nothing waits)
                    forward([rank], header, b"", {rank: [(rank, directory, "", 0)]})

    def _settle(self, msg_id: str, result: Any) -> None:
        client = self.client
        metadata = client.metadata[msg_id]
        client.outstanding.discard(msg_id)
        client._outstanding_dict[metadata["engine_uuid"]].discard(msg_id)
        client.results[msg_id] = result
        future = client._futures.get(msg_id)
        output = client._output_futures.get(msg_id)
        if future is not None and not future.done():
            future.set_result(result)
        forwarded = self._acks.pop(msg_id, None)
        if output is not None and forwarded is not None:
            # (its output came before it; complete once its leader's answer is in too)
            forwarded.add_done_callback(lambda _: output.done() or output.set_result(None))
        elif output is not None and not output.done():
            output.set_result(None)

    def _forget(self, msg_id: str) -> None:
        """What the client keeps of a part once it is in (its ``AsyncResult`` keeps its own)."""
        self._acks.pop(msg_id, None)  # (a part a death settled never took its leader's answer)
        for books in (self.client.results, self.client._futures, self.client._output_futures,
                      self.client.metadata):  # fmt: skip
            books.pop(msg_id, None)


_relays: weakref.WeakKeyDictionary[ipp.Client, Relay] = weakref.WeakKeyDictionary()


def register(client: ipp.Client, routes: dict[int, tuple[str, str]]) -> None:
    """From now on, ``client`` sends work for its ranks through their relay: ``routes`` maps
    each rank to its host and relay address."""
    _relays[client] = Relay(client, routes)


def reroute(client: ipp.Client, routes: dict[int, tuple[str, str]]) -> None:
    """``client``'s ranks are now ``routes`` (a resize): the relay keeps its name and counts,
    so the ranks that stay run their parts in order as before; a new rank counts from 1."""
    relay = _relays.get(client)
    if relay is None:
        register(client, routes)
    else:
        relay.routes = dict(routes)


def relay_of(client: ipp.Client) -> Relay | None:
    """``client``'s relay, once registered."""
    return _relays.get(client)
