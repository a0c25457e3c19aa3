"""Training data from a dask DataFrame, Array pair or Bag, laid out over the ranks' workers.

In the kernel only the plan is made; the rows never pass through it. Partition ``k`` is
computed on the worker of the rank that owns piece ``k`` (``axon_nb.rank.data.dask_shard``), the
partition lengths come back as numbers, and each rank's worker assembles the rank's pieces
(moving only the rows at piece edges from a neighbour). The loop then reads them from the
worker's memory in its own process.

Example::

    df = dd.read_parquet("data/*.parquet")
    cluster.train(model=make_model, data=df, columns=(["f0", "f1"], "label"), ...)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from axon_nb.cluster.transport import ClusterLike
    from axon_nb.rank.data.dask_shard import PiecesDataset
    from axon_nb.spec.dask_rows import DaskShards
    from axon_nb.spec.parallel_dims import ParallelDims


def partitions(data: Any, columns: tuple[Any, Any] | None) -> list[Any]:
    """One ``dask.delayed`` per partition, computing to ``(inputs, targets)`` arrays; raises
    ``ValueError`` for columns that do not exist or a collection of another kind."""
    import dask
    import dask.array as da
    import dask.bag as db
    import dask.dataframe as dd

    from axon_nb.spec.dask_rows import to_arrays

    convert = dask.delayed(to_arrays, pure=True)
    if isinstance(data, dd.DataFrame):
        if columns is None:
            raise ValueError(
                "a dask DataFrame needs columns=(features, target), e.g. "
                f"columns=([...], 'label'); its columns are {list(data.columns)}"
            )
        _check_columns(columns, list(data.columns))
        return [convert(p, columns) for p in data.to_delayed()]
    if columns is not None:
        raise ValueError("columns= is for a dask DataFrame; this data has no named columns")
    if isinstance(data, tuple):
        x, y = data
        if not (isinstance(x, da.Array) and isinstance(y, da.Array)):
            raise ValueError("a pair must be two dask arrays (inputs, targets)")
        if x.shape[0] != y.shape[0]:
            raise ValueError(f"inputs have {x.shape[0]} rows and targets {y.shape[0]}")
        x = x.rechunk({i: -1 for i in range(1, x.ndim)})
        y = y.rechunk((x.chunks[0], *[-1] * (y.ndim - 1)))
        xs, ys = x.to_delayed().reshape(-1), y.to_delayed().reshape(-1)
        pair = dask.delayed(tuple, pure=True)
        return [convert(pair([a, b]), None) for a, b in zip(xs, ys, strict=True)]
    if isinstance(data, db.Bag):
        return [convert(p, None) for p in data.to_delayed()]
    raise ValueError(
        f"dask data must be a DataFrame (with columns=), a pair of Arrays (inputs, targets) "
        f"or a Bag of (input, target) items, got {type(data).__name__}"
    )


def _check_columns(columns: Any, available: list[Any]) -> None:
    if not (isinstance(columns, tuple | list) and len(columns) == 2):
        raise ValueError(f"columns must be (features, target), got {columns!r}")
    features, target = columns
    wanted = [*features, *(target if isinstance(target, list | tuple) else [target])]
    missing = [c for c in wanted if c not in available]
    if missing:
        raise ValueError(f"no column {', '.join(map(repr, missing))}; the columns are {available}")


def check_rows(lengths: list[int], replicas: int, per_step: int) -> None:
    """Raise ``ValueError`` unless the pieces give each rank at least one step's rows."""
    count = len(lengths)
    if count % replicas:
        fit = -(-count // replicas) * replicas
        raise ValueError(
            f"the collection has {count} partitions; {replicas} data-parallel ranks each read "
            f"whole pieces, so it needs a multiple of {replicas}: e.g. "
            f"data.repartition(npartitions={fit})"
        )
    per_rank = sum(lengths) // count * (count // replicas)
    if per_rank < per_step:
        raise ValueError(
            f"the collection has {sum(lengths)} rows in {count} partitions: each of the "
            f"{replicas} data-parallel ranks gets {per_rank}, fewer than the {per_step} one "
            "step takes. Use a smaller batch_size or more data"
        )


def place(
    cluster: ClusterLike, data: Any, columns: Any, dims: ParallelDims, per_step: int
) -> tuple[DaskShards, list[Any]]:
    """Compute ``data`` on the ranks' workers and give each rank its pieces; the plan and
    the futures that keep the rows alive (release them when the run no longer needs them)."""
    import distributed

    from axon_nb.cluster.dask_on_ranks import workers_by_rank
    from axon_nb.spec.dask_rows import DaskShards, length, pieces_of

    parts = partitions(data, columns)
    client = cluster.dask()
    _check_futures(data, client)
    workers = workers_by_rank(client)
    data_ranks = {r: dims.data_rank(r)[0] for r in range(len(cluster.ranks))}
    owner = {d: min(r for r, i in data_ranks.items() if i == d) for d in set(data_ranks.values())}
    made: list[Any] = []  # every future made here: released on any failure

    def on_worker_of(k: int, fn: Any, *args: Any) -> Any:
        future = client.submit(fn, *args, workers=[workers[owner[k % dims.dp]]], pure=False)
        made.append(future)
        return future

    try:
        computed = [client.compute(part, workers=[workers[owner[k % dims.dp]]])
                    for k, part in enumerate(parts)]  # fmt: skip
        made += computed
        lengths = [int(n) for n in client.gather([on_worker_of(k, length, c)
                                                 for k, c in enumerate(computed)])]  # fmt: skip
        check_rows(lengths, dims.dp, per_step)
        keys, rows = {}, []
        for rank, d in data_ranks.items():
            owned = pieces_of(d, dims.dp, lengths)
            needed = {s.part: computed[s.part] for piece in owned for s in piece}
            future = client.submit(
                _assemble_rank, needed, owned, workers=[workers[rank]], pure=False
            )
            made.append(future)
            rows.append(future)
            keys[rank] = future.key
        distributed.wait(rows)
        for future in rows:
            future.result()  # raise an error computing the data here, in the kernel
    except BaseException:
        for future in made:
            future.release()
        raise
    for future in made:  # the partitions and counts may go once the pieces are built
        if future not in rows:
            future.release()
    shards = DaskShards(
        keys=keys,
        pieces=len(lengths),
        piece_rows=sum(lengths) // len(lengths),
        replicas=dims.dp,
        data_ranks=data_ranks,
    )
    return shards, rows


def _check_futures(data: Any, client: Any) -> None:
    """Raise ``ValueError`` when ``data`` was persisted through a client that is closed or
    talks to another scheduler: its rows are not on the ranks' workers."""
    from distributed import futures_of

    for future in futures_of(data):
        if future.client.status != "running":
            raise ValueError(
                "the collection was persisted, but its dask client was closed, so the rows it "
                "held are gone: build the collection again (or persist it again with "
                "cluster.dask())"
            )
        if future.client.scheduler.address != client.scheduler.address:
            raise ValueError(
                "the collection was persisted on another dask cluster; build it again, or "
                "persist it with cluster.dask() so its rows are on the ranks"
            )


def _assemble_rank(parts: dict[int, Any], owned: Any) -> Any:
    from axon_nb.spec.dask_rows import assemble

    return assemble(parts, owned)


def local(data: Any, columns: Any, per_step: int) -> PiecesDataset:
    """The whole collection computed in this process as one data-parallel rank's pieces
    (what ``train_local`` trains on)."""
    import dask

    from axon_nb.rank.data.dask_shard import PiecesDataset
    from axon_nb.spec.dask_rows import assemble, length, pieces_of

    parts = dask.compute(*partitions(data, columns))
    lengths = [length(p) for p in parts]
    check_rows(lengths, 1, per_step)
    x, y = assemble(list(parts), pieces_of(0, 1, lengths))
    rows = sum(lengths) // len(lengths)
    return PiecesDataset(x, y, pieces=len(lengths), piece_rows=rows, data_rank=0, replicas=1)
