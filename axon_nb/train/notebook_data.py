"""Datasets built in the notebook, sent to each host once and kept there between calls.

``data=ds``, where ``ds`` is an object made in the notebook (a ``TensorDataset``, a dataset
class of the notebook's own holding tensors, ...), would otherwise be pickled whole and sent
to every rank on every call, and each rank would keep its own copy. Instead ``start_run``
gives it to :func:`share`, which

- pickles the dataset with cloudpickle, leaving out every CPU tensor and NumPy array of
  numbers (a pandas DataFrame's blocks too) of at least :data:`MIN_TENSOR_BYTES` (the
  *skeleton*: classes, attributes, small tensors, a small view as a compact copy of its own;
  sent with every call, so changes to them always arrive);
- sends what it left out as the storage spans their views use (``train/storage_spans.py``:
  views of one storage go once and are rebuilt on the ranks as the same views), each span
  named by a key: the same arrays with the same layouts and fingerprint keep it from call to
  call;
- asks the ranks which keys they hold (one small round trip) and sends each missing tensor
  once per host: one rank of the host writes it into an owner-only file under ``/dev/shm``,
  every rank of the host maps that file, and the file is unlinked at once
  (``axon_nb.rank.data.shared_tensors``). The host keeps one copy in memory, freed when the
  ranks drop the key (the tensor changed, it was garbage-collected in the notebook, or
  :func:`forget`) and in any case when the ranks end: a stopped cluster leaves nothing in
  ``/dev/shm``.

What counts as a change (a new key, so the tensor is sent again):

- another tensor object (the dataset holds new tensors, or another dataset is passed);
- any in-place torch operation on the tensor or on a view of it (``x[0] = 1``, ``x.mul_(2)``,
  ``x.copy_(y)``, ``torch.add(a, b, out=x)``): torch's version counter of the tensor;
- another shape, dtype, strides, storage offset or data pointer (``x.set_(...)``,
  ``x.resize_(...)``);
- writes that torch does not count (through ``x.numpy()``, ``x.data``, or the NumPy array
  ``torch.from_numpy`` was given) only when they change one of :data:`SAMPLES` windows of
  :data:`WINDOW_BYTES` bytes spread evenly over the tensor (first and last bytes included).
  After such a write call :func:`forget`, or pass a new tensor.

Tensors that are not plain CPU tensors (``nn.Parameter``, tensors that require grad, sparse,
quantized or on a device) and tensors past the first :data:`MAX_TENSORS` travel in the
skeleton as before, as does every dataset given as a callable (``data=make_dataset``, or
``data=lambda: ds``: the callable form is never cached). The ranks rebuild the dataset
around their host's copy: code on a rank that writes into the dataset's tensors writes for
every rank of the host (such a tensor is dropped and sent again at the next call).

Example::

    ds = TensorDataset(torch.randn(50_000, 1024), torch.randn(50_000, 1))
    cluster.train(model=make_model, data=ds, steps=100, batch_size=64)  # sends 205 MB per host
    cluster.train(model=make_model, data=ds, steps=100, batch_size=64)  # sends a few hundred B
    notebook_data.stats(cluster)
    # NotebookDataStats(calls=2, checks=2, tensors_sent=2, bytes_sent=205000000, tensors_reused=2)
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import pickle
import sys
import uuid
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import cloudpickle

from axon_nb.rank import entry
from axon_nb.spec.dask_rows import is_dask_data
from axon_nb.spec.shared_data import SharedData, SharedTensor
from axon_nb.train import storage_spans
from axon_nb.train.storage_spans import Span

if TYPE_CHECKING:
    from axon_nb.cluster.transport import ClusterLike

MIN_TENSOR_BYTES = 1 << 20
"""Smaller tensors travel in the skeleton with every call."""
MAX_TENSORS = 4096
"""At most this many tensors of one dataset are held on the hosts (each is one mapping)."""
MESSAGE_BYTES = 64 << 20
"""Bytes of tensor data per message to a host (the kernel and the rank hold one at a time)."""
SAMPLES = 64
"""Windows of a tensor's bytes hashed into its fingerprint."""
WINDOW_BYTES = 256
"""Bytes in each window."""


@dataclass
class NotebookDataStats:
    """What :func:`share` did on one cluster (see :func:`stats`)."""

    calls: int = 0
    """Runs given a notebook dataset with tensors to hold on the hosts."""
    checks: int = 0
    """Round trips asking the ranks which tensors they hold."""
    tensors_sent: int = 0
    """Tensors sent, counted once per host that received them."""
    bytes_sent: int = 0
    """Bytes of tensor data sent, counted once per host that received them."""
    tensors_reused: int = 0
    """Tensors a run found already held on every host, counted once per run."""


@dataclass
class _Entry:
    refs: list[weakref.ref[Any]]
    fingerprint: tuple[Any, ...]
    key: str

    def alive(self, arrays: list[Any] | None = None) -> bool:
        """Whether the arrays are all still there (and are ``arrays``, if given)."""
        held = [ref() for ref in self.refs]
        if arrays is None:
            return all(a is not None for a in held)
        return len(held) == len(arrays) and all(h is a for h, a in zip(held, arrays, strict=True))


@dataclass
class _Cache:
    """One cluster's notebook tensors: their keys, and what the ranks were last seen holding."""

    entries: dict[tuple[int, ...], _Entry] = field(default_factory=dict)
    """The ``id``s of a span's arrays -> its entry (the weak references tell reused ids
    apart)."""
    world: tuple[Any, ...] = ()
    """The ranks' (host, pid) when ``confirmed`` was taken: other processes hold nothing."""
    confirmed: set[str] = field(default_factory=set)
    """Keys every rank held after the latest check or transfer."""
    drop: set[str] = field(default_factory=set)
    """Keys the ranks may let go of, told with the next check."""
    stats: NotebookDataStats = field(default_factory=NotebookDataStats)

    def key_for(self, span: Span, torch: Any) -> str:
        """``span``'s key: kept while its arrays are the same objects, laid out the same, with
        the same fingerprint."""
        self._sweep()
        fingerprint = (tuple(span.layouts), _digest(span.tensor, torch))
        ident = tuple(id(a) for a in span.arrays)
        entry = self.entries.get(ident)
        if entry is not None and entry.alive(span.arrays) and entry.fingerprint == fingerprint:
            return entry.key
        if entry is not None:
            self.drop.add(entry.key)
        key = uuid.uuid4().hex
        self.entries[ident] = _Entry([weakref.ref(a) for a in span.arrays], fingerprint, key)
        return key

    def _sweep(self) -> None:
        """Forget arrays the notebook no longer holds; the ranks drop them at the next check."""
        for ident, known in list(self.entries.items()):
            if not known.alive():
                del self.entries[ident]
                self.drop.add(known.key)


_caches: weakref.WeakKeyDictionary[Any, _Cache] = weakref.WeakKeyDictionary()


def share(cluster: ClusterLike, data: Any) -> SharedData | None:
    """``data`` as the ranks should receive it when it is a dataset object: its large CPU
    tensors held by each host (sent only where missing), the rest pickled in the skeleton
    (all of it when it holds no such tensor: pickled once, as it always was). None for a
    callable or a dask collection, which travel as they are. Example::

        shared = share(cluster, TensorDataset(x, y))   # SharedData(312 bytes, tensors=[...])
    """
    torch = sys.modules.get("torch")  # no tensor exists in a process that never imported it
    if torch is None or not _is_object(data):
        return None
    skeleton, arrays = _split(data, torch.Tensor)
    if not arrays:
        return SharedData(skeleton, ())
    cache = _caches.setdefault(cluster, _Cache())
    world = tuple((r.get("host"), r.get("pid")) for r in cluster.ranks)
    if world != cache.world:  # a restarted or re-formed cluster: its ranks hold nothing
        cache.world, cache.confirmed, cache.drop = world, set(), set()
    spans = storage_spans.plan(arrays, torch)
    tensors = [span.tensor for span in spans]
    metas = tuple(
        SharedTensor(
            cache.key_for(span, torch), str(t.dtype).removeprefix("torch."), tuple(t.shape)
        )
        for span, t in zip(spans, tensors, strict=True)
    )
    views = {
        i: dataclasses.replace(v, tensor=n)
        for n, sp in enumerate(spans)
        for i, v in sp.views.items()
    }
    shared = SharedData(skeleton, metas, tuple(views[i] for i in range(len(arrays))))
    cache.stats.calls += 1
    keys = {m.key for m in metas}
    run = getattr(cluster, "last_run", None)
    if keys <= cache.confirmed and run is not None and not run.done:
        # The ranks are busy with a run: a check would wait for its end; what they held when
        # it started they hold now (a run never drops a tensor).
        cache.stats.tensors_reused += len(metas)
        return shared
    _send_missing(cluster, cache, metas, tensors, torch)
    return shared


def stats(cluster: ClusterLike) -> NotebookDataStats:
    """What notebook datasets cost ``cluster`` so far: runs, checks, tensors and bytes sent.
    Example::

        before = stats(cluster).bytes_sent
        cluster.train(model=make_model, data=ds, steps=10, batch_size=64)
        stats(cluster).bytes_sent - before   # 0 when ds was sent before and is unchanged
    """
    return _caches.setdefault(cluster, _Cache()).stats


def forget(cluster: ClusterLike) -> None:
    """Let go of every notebook tensor ``cluster``'s hosts hold (the next call sends them
    again), e.g. after writing into a tensor through ``.numpy()``. Example::

        x.numpy()[:] = 0          # torch does not see this write
        forget(cluster)
        cluster.train(model=make_model, data=ds, ...)   # sends ds's tensors again
    """
    cache = _caches.get(cluster)
    if cache is None:
        return
    cache.drop |= {e.key for e in cache.entries.values()} | cache.confirmed
    cache.entries.clear()
    cache.confirmed.clear()
    if cluster.running:
        cluster.run(entry.shared_held, [], sorted(cache.drop), stream=False)
        cache.drop.clear()


def _is_object(data: Any) -> bool:
    """A dataset object, not a factory (the test ``resolve_dataset`` makes on the ranks)."""
    if data is None or isinstance(data, type) or is_dask_data(data):
        return False
    return not (callable(data) and not hasattr(data, "__getitem__"))


class _Splitter(cloudpickle.Pickler):
    """cloudpickle, with each large plain CPU tensor and NumPy array (a pandas DataFrame's
    columns too) replaced by its index in ``arrays``."""

    def __init__(self, file: io.BytesIO, tensor_type: type[Any]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._tensor_type = tensor_type
        numpy = sys.modules.get("numpy")
        self._array_type = numpy.ndarray if numpy is not None else None
        self._index: dict[int, int] = {}
        self.arrays: list[Any] = []

    def persistent_id(self, obj: Any) -> int | None:
        kind = type(obj)  # (subclasses such as Parameter or np.matrix are pickled)
        if kind is self._tensor_type:
            shareable = _shareable(obj)
        elif kind is self._array_type and kind is not None:
            shareable = _shareable_array(obj)
        else:
            return None
        index = self._index.get(id(obj))
        if index is None and shareable and len(self.arrays) < MAX_TENSORS:
            index = self._index[id(obj)] = len(self.arrays)
            self.arrays.append(obj)
        return index

    def reducer_override(self, obj: Any) -> Any:
        """A small view of a large storage is pickled as a compact copy: torch pickles a
        view's whole storage (a column cut from a 100 MB matrix would carry the 100 MB)."""
        if type(obj) is self._tensor_type and _drags_storage(obj):
            return obj.clone().__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        return super().reducer_override(obj)


def _split(data: Any, tensor_type: type) -> tuple[bytes, list[Any]]:
    """The skeleton of ``data`` and the arrays left out of it, in persistent-id order."""
    buffer = io.BytesIO()
    pickler = _Splitter(buffer, tensor_type)
    pickler.dump(data)
    return buffer.getvalue(), pickler.arrays


def _plain(t: Any) -> bool:
    """A dense CPU tensor that needs no autograd: its values are all it is."""
    return t.device.type == "cpu" and str(t.layout) == "torch.strided" and not t.requires_grad


def _shareable(t: Any) -> bool:
    return _plain(t) and not t.is_quantized and t.nbytes >= MIN_TENSOR_BYTES


def _drags_storage(t: Any) -> bool:
    """A plain CPU tensor whose storage is over twice its own bytes (and not small)."""
    if not _plain(t):
        return False
    storage = t.untyped_storage().nbytes()
    return storage > 2 * t.nbytes and storage >= MIN_TENSOR_BYTES


def _shareable_array(a: Any) -> bool:
    """A NumPy array torch can view: numbers or booleans, byte strides that step forward by
    whole elements, at least :data:`MIN_TENSOR_BYTES`."""
    return (
        a.dtype.kind in "biufc"
        and a.dtype.isnative
        and a.nbytes >= MIN_TENSOR_BYTES
        and all(s >= 0 and s % a.itemsize == 0 for s in a.strides)
    )


def _bytes_of(t: Any, torch: Any) -> Any:
    """``t``'s values as a flat NumPy array of bytes (a view when ``t`` is contiguous)."""
    return t.resolve_conj().resolve_neg().reshape(-1).view(torch.uint8).numpy()


def _digest(t: Any, torch: Any) -> bytes:
    """A hash of :data:`SAMPLES` windows of contiguous ``t``'s bytes (see the module doc), in
    microseconds."""
    flat = _bytes_of(t, torch)
    digest = hashlib.blake2b(digest_size=16)
    last = max(flat.size - WINDOW_BYTES, 0)
    for i in range(SAMPLES):
        start = last * i // (SAMPLES - 1)
        digest.update(flat[start : start + WINDOW_BYTES])
    return digest.digest()


def _send_missing(
    cluster: ClusterLike, cache: _Cache, metas: tuple[SharedTensor, ...], tensors: list[Any],
    torch: Any,
) -> None:  # fmt: skip
    """Ask every rank what it holds (dropping ``cache.drop``), then send each host what any
    of its ranks lacks."""
    keys = [m.key for m in metas]
    asked = sorted(set(keys) | (cache.confirmed - cache.drop))
    held = cluster.run(entry.shared_held, asked, sorted(cache.drop), stream=False)
    cache.stats.checks += 1
    cache.drop.clear()
    cache.confirmed = {k for k in asked if all(k in h for h in held)}
    hosts: dict[str, list[int]] = {}
    for r in cluster.ranks:
        hosts.setdefault(r["host"], []).append(r["rank"])
    wanted: dict[tuple[int, ...], list[str]] = {}  # tensors missing -> the hosts missing them
    for host, ranks in hosts.items():
        missing = tuple(i for i, k in enumerate(keys) if any(k not in held[r] for r in ranks))
        if missing:
            wanted.setdefault(missing, []).append(host)
    for missing, to in wanted.items():
        _transfer(cluster, {h: hosts[h] for h in to}, [metas[i] for i in missing],
                  [tensors[i] for i in missing], torch)  # fmt: skip
        cache.stats.tensors_sent += len(missing) * len(to)
        cache.stats.bytes_sent += sum(tensors[i].nbytes for i in missing) * len(to)
    cache.stats.tensors_reused += len(metas) - len({i for m in wanted for i in m})
    cache.confirmed |= set(keys)


def _transfer(
    cluster: ClusterLike, hosts: dict[str, list[int]], metas: list[SharedTensor],
    tensors: list[Any], torch: Any,
) -> None:  # fmt: skip
    """Send ``tensors`` to the first rank of each of ``hosts``, which writes them to files;
    every rank of the host maps them; the files are then unlinked (also on any failure)."""
    writers = {host: min(ranks) for host, ranks in hosts.items()}
    order = sorted(writers, key=writers.__getitem__)  # results come back in rank order
    paths: dict[str, dict[str, str]] = {host: {} for host in hosts}
    try:
        for pieces in _pieces(metas, tensors, torch):
            created = cluster.run(
                entry.shared_write, pieces, ranks=[writers[h] for h in order], stream=False
            )
            for host, made in zip(order, created, strict=True):
                paths[host].update(made)
        copies = {host: [(m, paths[host][m.key]) for m in metas] for host in hosts}
        every = sorted(r for ranks in hosts.values() for r in ranks)
        cluster.run(entry.shared_map, copies, ranks=every, stream=False)
    finally:
        with contextlib.suppress(Exception):  # (each writer's parent removes what is left)
            keys = [m.key for m in metas]
            cluster.run(entry.shared_unlink, keys, ranks=[writers[h] for h in order], stream=False)


def _pieces(
    metas: list[SharedTensor], tensors: list[Any], torch: Any
) -> Iterator[list[tuple[str, int, int, Any]]]:
    """Messages of at most :data:`MESSAGE_BYTES` of ``(key, nbytes, offset, bytes)``."""
    message: list[tuple[str, int, int, Any]] = []
    size = 0
    for meta, t in zip(metas, tensors, strict=True):
        flat = _bytes_of(t, torch)
        offset = 0
        while offset < flat.size:
            chunk = flat[offset : offset + MESSAGE_BYTES - size]
            message.append((meta.key, flat.size, offset, chunk))
            size += chunk.size
            offset += chunk.size
            if size >= MESSAGE_BYTES:
                yield message
                message, size = [], 0
    if message:
        yield message
