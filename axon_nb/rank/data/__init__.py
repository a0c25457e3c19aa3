"""Each rank's data: its shard of a dataset cut into micro-batches, streams, dask pieces and
the rank's dask worker, batches copied a step ahead."""
