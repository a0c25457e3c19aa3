"""The metrics stream: what each rank publishes while it trains, a few times a second at most.

Every rank calls ``ipyparallel``'s ``publish_data`` with one dict (the kernel reads it from the
run's ``AsyncResult`` while the run goes on). ipyparallel merges successive dicts key by key, so
each publication is self-contained: it repeats the records of the previous publication as well,
and a reader that misses one publication loses nothing. Readers de-duplicate by ``step``.

Schema ``axon_nb.metrics/1`` (all sizes in bytes, all times in seconds)::

    {
      "schema": "axon_nb.metrics/1",
      "run": str,              # id of this train() call, the same on every rank
      "name": str,             # name of the model on the ranks
      "rank": int,
      "status": "running" | "finished" | "stopped" | "failed",
      "error": str | None,     # "ExcType: message" when status is "failed"
      "step": int,             # global step count after the last finished step
      "start_step": int,       # global step count when this call started
      "total_steps": int,      # global step count this call trains up to
      "elapsed_s": float,      # since this call started on this rank
      "heartbeat": float,      # time.time() of this publication
      "memory": {...},         # metrics.memory.snapshot(): param_bytes, grad_bytes,
                               # optimizer_bytes, rss_bytes, peak_bytes (once the first step
                               # ran) [, cuda_allocated, cuda_reserved, cuda_peak]
      "comm_totals": {kind: {"bytes", "time_s", "count"}},   # since the call started
      "checkpoint": {"step": int, "path": str} | None,  # with train(checkpoint_dir=...):
                               # the newest complete periodic checkpoint of this call
      "records": [             # recent steps, oldest first
        {
          "step": int,           # global step number (1-based) this record ends
          "loss": float,         # mean loss over the global batch (same on every rank)
          "rank_loss": float | None,   # this rank's mean loss over its micro-batches (None
                                       # where it computes none: earlier pipeline stages)
          "lr": float,           # learning rate used by the step
          "grad_norm": float | None,   # global grad norm before clipping (when clipping)
          "samples": int,        # global samples in the step
          "step_time_s": float,  # this rank's wall time for the step
          "samples_per_s": float,      # samples / step_time_s
          "comm": {kind: {"bytes", "time_s", "count"}},      # this rank, this step
          "comm_bytes": int, "comm_time_s": float,           # sums over kinds
          # pipeline strategies only (Strategy.report), this rank's stages in this step:
          "forward_s": float, "backward_s": float,  # time computing forward / backward chunks
          "bubble": float,       # 1 - (forward_s + backward_s) / schedule wall time
          # expert parallelism only, this rank in this step (all MoE layers together):
          "expert_tokens": [int, ...],  # tokens it routed to each expert (global index)
        }, ...
      ],
    }

Collective kinds are those of :data:`axon_nb.metrics.comm.KINDS` (``all_reduce``,
``all_gather``, ``reduce_scatter``, ``broadcast``, ``all_to_all``, ``send_recv``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

SCHEMA = "axon_nb.metrics/1"
STATUSES = ("running", "finished", "stopped", "failed")


RESEND_S = 2.0
"""A publication repeats the records of the publications of the last ``RESEND_S`` seconds (at
least the previous one): the kernel reads only an engine's latest publication (ipyparallel
keeps the last), polling every 0.1 s and later when it is loaded, so records of a publication
it never read would be lost from the history."""

RESEND_MAX = 1024
"""At most this many repeated records in one publication (the most recent)."""


class MetricsPublisher:
    """Buffers step records and publishes them, throttled to one message per ``interval_s``.

    ``sink`` is ``publish_data`` on an engine, or None (nothing is sent: ``train_local``).
    """

    def __init__(
        self,
        sink: Callable[[dict[str, Any]], None] | None,
        *,
        header: dict[str, Any],
        interval_s: float,
    ) -> None:
        self._sink = sink if interval_s > 0 else None
        self._header = header
        self._interval_s = interval_s
        self._last_sent = float("-inf")
        self._sent: list[tuple[float, list[dict[str, Any]]]] = []
        """(when, records) of the recent publications, which the next one repeats."""
        self._pending: list[dict[str, Any]] = []
        self.records: list[dict[str, Any]] = []
        """Every record of this call, for the final result."""

    def add(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        self._pending.append(record)

    def due(self) -> bool:
        """True when the next :meth:`publish` would send (the caller may then gather memory)."""
        return self._sink is not None and time.monotonic() - self._last_sent >= self._interval_s

    def publish(self, status: str = "running", **fields: Any) -> None:
        """Send one message with the records since the previous one and those of the
        publications of the last ``RESEND_S`` seconds."""
        if self._sink is None:
            return
        now = time.monotonic()
        recent = [sent for sent in self._sent[:-1] if now - sent[0] <= RESEND_S]
        self._sent = recent + self._sent[-1:]
        repeated = [record for _, records in self._sent for record in records][-RESEND_MAX:]
        message = {
            "schema": SCHEMA,
            **self._header,
            "status": status,
            "error": None,
            "heartbeat": time.time(),
            **fields,
            "records": repeated + self._pending,
        }
        self._sink(message)
        self._last_sent = now
        self._sent.append((now, self._pending))
        self._pending = []
