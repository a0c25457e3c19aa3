"""The ranks' side of the host relay (the kernel's side: ``axon_nb/cluster/relay.py``).

Work for several ranks reaches one rank per host through ipyparallel, the host's *leader*
(the kernel picks a target rank there, ``cluster/relay.py``), in :func:`forward`; the
leader passes it on to each target rank of its host (itself included) through a local
socket, and returns at once. Each rank runs its part on its engine's event loop, in the
main thread, as ipyparallel runs a request (Ctrl-C, output under the part's own message id,
abort), then hands back the outcome (result or error) from its IOPub thread, after
everything the part published:

- a part that published nothing (no output, no display) hands it to the leader, which
  publishes its host's outcomes of the call as one message (``relay_outcomes.py``);
- a part that did publish something publishes its outcome itself, on the same channel as
  its output, so the kernel cannot see the outcome before the output (and tells the leader
  not to wait for it); so does a rank whose leader has died.

The kernel so sends one message per host and, for calls without output, reads about one per
host, instead of three per rank (the reply, the busy and idle statuses); the engines skip
ipyparallel's request handling.

Each rank's sockets are Unix sockets in its own owner-only directory: only the user's own
processes on the same host can connect (the relay carries code to run).

    directory = open_relay()   # at start-up, on every rank
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import os
import shutil
import sys
import tempfile
from typing import Any

from axon_nb.rank.world.packed_call import run_packed
from axon_nb.rank.world.relay_order import Order
from axon_nb.rank.world.relay_outcomes import Collector, publish
from axon_nb.spec.processes import pid_alive

_state: dict[str, Any] = {}
"""This engine's relay: ``rank``, ``directory``, the work ``stream``, the ``collector`` of
outcomes, the ``pushes`` of work (main thread) and of outcomes (IOPub thread) by address,
``sent``: how many IOPub messages this engine has sent (a one-item list), and the ``order``
of the parts (``relay_order.py``)."""


def open_relay() -> str:
    """Bind this rank's relay sockets (work, and outcomes when it leads) in a new owner-only
    directory and handle the work that arrives on the engine's event loop (this runs in the
    engine's main thread, on that loop); the directory. Idempotent. Example::

        open_relay()   # '/tmp/axon-relay-1-x8k2' (on rank 1)
    """
    if "directory" in _state:
        return str(_state["directory"])
    import tornado.ioloop
    import zmq
    from zmq.eventloop.zmqstream import ZMQStream

    kernel = _kernel()
    rank = int(kernel.engine_id)  # (the engine id is the rank)
    directory = tempfile.mkdtemp(prefix=f"axon-relay-{rank}-")  # 0700: this user only
    atexit.register(shutil.rmtree, directory, True)
    pull: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PULL)
    pull.bind(f"ipc://{directory}/work")
    stream = ZMQStream(pull, tornado.ioloop.IOLoop.current())
    stream.on_recv(_arrived)
    collector = Collector(kernel, rank, f"ipc://{directory}/outcomes")
    sent = _count_sent(kernel.iopub_socket)
    _state.update(rank=rank, directory=directory, stream=stream, collector=collector,
                  pushes={}, outcome_pushes={}, cells=set(), sent=sent, order=Order())  # fmt: skip
    return directory


def _count_sent(iopub: Any) -> list[int]:
    """Count what the engine sends or writes for its IOPub channel: every message (output,
    display, data publication, status) goes through its ``send_multipart``, and what is
    printed is written to ``sys.stdout`` or ``sys.stderr`` first (sent later, by a timer)."""
    sent = [0]

    def counting(send: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            sent[0] += 1
            return send(*args, **kwargs)

        return counted

    iopub.send_multipart = counting(iopub.send_multipart)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, TypeError):  # (a stream that is not ipykernel's)
            vars(stream)["write"] = counting(stream.write)  # (the instance's own method)
    return sent


def forward(header: dict[str, Any], payload: bytes,
            plan: dict[int, list[tuple[int, str, str, int]]]) -> int:  # fmt: skip
    """(The leader, as an ipyparallel request) pass the work on to this host's target ranks:
    ``plan[my rank]`` lists each one's ``(rank, relay directory, message id, seq)`` (``seq``:
    the part's number among those the kernel sent that rank, ``relay_order.py``). Their output
    goes under the kernel's session, so the kernel reads it; the number passed on. A header of
    kind "skip" (the kernel's, after another leader failed) names numbers this rank will not
    get (``skip``), and expects no outcome."""
    import zmq

    parent = dict(_kernel().get_parent("shell")["header"])
    mine = plan[_state["rank"]]
    if header["kind"] != "skip":
        _state["collector"].expect(header["call"], len(mine))
    leader = {"leader": _state["directory"], "leader_pid": os.getpid()}
    for _, directory, msg_id, seq in mine:
        part = {**header, **leader, "seq": seq, "parent": {**parent, "msg_id": msg_id}}
        _push("pushes", f"ipc://{directory}/work").send_multipart(
            [json.dumps(part).encode(), payload], zmq.NOBLOCK
        )
    return len(mine)


def _arrived(frames: list[bytes]) -> None:
    """A part (or the kernel's word to skip some) has come: run what is now due, in order."""
    header = json.loads(frames[0])
    order: Order[tuple[dict[str, Any], list[bytes]]] = _state["order"]
    if header["kind"] == "skip":
        due = order.skip(header["epoch"], header["skip"])
    else:
        due = order.admit(header["epoch"], header["seq"], (header, frames))
    for part_header, part_frames in due:
        try:
            _run(part_header, part_frames)
        except Exception as e:  # (its outcome could not be made: the parts after it still run)
            content = {"status": "error", "ename": type(e).__name__, "evalue": str(e),
                       "traceback": [], "engine_info": {}}  # fmt: skip
            _hand_back(_kernel(), part_header, content, [], published=False)


def _run(header: dict[str, Any], frames: list[bytes]) -> None:
    kernel = _kernel()
    msg_id = header["parent"]["msg_id"]
    if msg_id in kernel.aborted:  # the kernel aborted it before it got here
        kernel.aborted.discard(msg_id)
        _hand_back(kernel, header, {"status": "aborted"}, [], published=False)
        return
    transformed = _awaiting(kernel.shell, frames[1].decode()) if header["kind"] == "code" else None
    if transformed is not None:
        task = asyncio.ensure_future(
            _run_cell_async(kernel, header, frames[1].decode(), transformed)
        )
        _state["cells"].add(task)  # (held until done: the loop keeps only a weak reference)
        task.add_done_callback(_state["cells"].discard)
        return
    _begin(kernel, header)
    try:
        content, buffers = run_relayed(kernel, header["kind"], frames[1])
    finally:
        kernel.post_handler_hook()
    _end(kernel, header, content, buffers)


async def _run_cell_async(kernel: Any, header: dict[str, Any], code: str, transformed: str
                          ) -> None:  # fmt: skip
    """A cell with a top-level ``await``, run on the engine's event loop as ipykernel runs it."""
    _begin(kernel, header)
    try:
        result = await kernel.shell.run_cell_async(
            code, store_history=True, silent=False, transformed_cell=transformed
        )
        content = _cell_content(kernel, result)
    except BaseException as e:  # (IPython reports the cell's own errors in its result)
        content = _error_content(kernel, kernel.shell, e, "execute")
    finally:
        kernel.post_handler_hook()
    _end(kernel, header, content, [])


def _begin(kernel: Any, header: dict[str, Any]) -> None:
    parent = {"header": header["parent"], "parent_header": {}, "metadata": {}, "content": {}}
    kernel.set_parent([], parent, "shell")  # what it prints goes under its own message id
    header["sent_before"] = _state["sent"][0]
    kernel.pre_handler_hook()  # (SIGINT raises in the user's code from here, as in a request)


def _end(kernel: Any, header: dict[str, Any], content: dict[str, Any], buffers: list[Any]
         ) -> None:  # fmt: skip
    """Hand the outcome back: at once to the leader when the part sent and wrote nothing,
    else from the IOPub thread, after what it sent there."""
    if _state["sent"][0] == header["sent_before"]:
        _hand_back(kernel, header, content, buffers, published=False)
        return
    kernel.iopub_socket.schedule(
        lambda: _hand_back(kernel, header, content, buffers, published=True)
    )


def _awaiting(shell: Any, code: str) -> str | None:
    """``code`` transformed by IPython when it has a top-level ``await`` (IPython's test, only
    for cells that may), else None."""
    if "await" not in code:
        return None
    try:
        transformed = str(shell.transform_cell(code))
    except Exception:
        return None  # (run_cell reports it)
    return transformed if shell.should_run_async(code, transformed_cell=transformed) else None


def run_relayed(kernel: Any, kind: str, payload: bytes) -> tuple[dict[str, Any], list[Any]]:
    """Run one relayed part: a packed call (``kind`` "call", as ``entry.call`` runs it) or a
    cell (``kind`` "code"); the outcome's content and buffers, as ipyparallel replies."""
    from ipyparallel.serialize import serialize_object

    shell = kernel.shell
    if kind == "code":
        result = shell.run_cell(payload.decode(), store_history=True, silent=False)
        return _cell_content(kernel, result), []
    try:
        value = run_packed(payload)
        buffers = serialize_object(  # (a result that cannot be sent fails the part)
            value,
            buffer_threshold=kernel.session.buffer_threshold,
            item_threshold=kernel.session.item_threshold,
        )
    except BaseException as e:
        with contextlib.suppress(Exception):  # (IPython's formatting, published as a
            shell.showtraceback()  # request's error would be)
        return _error_content(kernel, shell, e, "apply"), []
    return {"status": "ok"}, buffers


def _cell_content(kernel: Any, result: Any) -> dict[str, Any]:
    """The outcome of a cell from IPython's ``ExecutionResult``, as ipykernel replies."""
    error = result.error_before_exec or result.error_in_exec
    content = {"status": "ok"}
    if error is not None:
        content = _error_content(kernel, kernel.shell, error, "execute")
    return {**content, "execution_count": result.execution_count}


def _error_content(kernel: Any, shell: Any, error: BaseException, method: str) -> dict[str, Any]:
    try:
        evalue = str(error)
    except Exception as e:
        evalue = f"(its message could not be made: {e})"
    traceback = shell._last_traceback or []  # (ipykernel's record of the formatted traceback)
    shell._last_traceback = None
    return {
        "status": "error",
        "ename": type(error).__name__,
        "evalue": evalue,
        "traceback": traceback,
        "engine_info": kernel.get_engine_info(method=method),
    }


def _hand_back(kernel: Any, header: dict[str, Any], content: dict[str, Any],
               buffers: list[Any], *, published: bool) -> None:  # fmt: skip
    """The outcome: to the leader when the part sent and wrote nothing (on the main thread),
    else on this rank's own channel behind its output (on the IOPub thread, after what the
    part sent there, and after sending what the streams hold); see the module."""
    import zmq

    if published:
        for stream in (sys.stdout, sys.stderr):  # (on this thread: sent now, not later)
            with contextlib.suppress(Exception):
                stream.flush()
    outcome = {"call": header["call"], "parent": header["parent"], "content": content}
    leader = f"ipc://{header['leader']}/outcomes"
    alive = pid_alive(header["leader_pid"])
    pushes = "outcome_pushes" if published else "pushes"  # (the thread's own sockets)
    try:
        if alive and not published:
            _push(pushes, leader).send_multipart([json.dumps(outcome).encode(), *buffers],
                                                 zmq.NOBLOCK)  # fmt: skip
            return
        publish(kernel, _state["rank"], [(outcome, buffers)])
        if alive:  # (so that it does not wait for this one)
            done = json.dumps({"call": header["call"], "published": True}).encode()
            _push(pushes, leader).send_multipart([done], zmq.NOBLOCK)
    except Exception as e:  # (the IOPub thread must go on)
        print(f"axon_nb: could not hand back a relayed outcome: {e}", file=sys.__stderr__)


def _push(kind: str, address: str) -> Any:
    """A PUSH socket to ``address``, one per thread's use (``kind``: "pushes" on the main
    thread, "outcome_pushes" on the IOPub thread; a socket is not shared between threads)."""
    import zmq

    pushes = _state[kind]
    if address not in pushes:
        pushes[address] = zmq.Context.instance().socket(zmq.PUSH)
        pushes[address].connect(address)
    return pushes[address]


def _kernel() -> Any:
    from IPython import get_ipython

    return get_ipython().kernel
