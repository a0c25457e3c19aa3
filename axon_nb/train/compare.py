"""``cluster.compare``: several strategies trained a few steps each on the live ranks, side by
side: samples/s, peak memory per rank, communication per step, time in collectives, loss,
and beside them what ``axon_nb.estimate.predict`` said of each before it ran.

Each candidate trains the same model and data from the same seed under a name of its own,
which is dropped afterwards so the next one has the memory. A candidate that cannot run
(its layout does not fit the world, a rank raises, runs out of memory or dies) gets the reason
in its row, and the others still run (a dead rank's cluster is restarted first).

Example::

    cluster.compare([DDP(), ZeRO(stage=2), FSDP()], model=make_model, data=ds, steps=20,
                    batch_size=32)
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from axon_nb.errors import ClusterBrokenError, RankDiedError, RankError
from axon_nb.rank import entry
from axon_nb.spec.validation import check_world
from axon_nb.strategies import resolve_strategy
from axon_nb.tables import html_table, text_table

if TYPE_CHECKING:
    from axon_nb.cluster.transport import ClusterLike
    from axon_nb.spec.train_spec import TrainSpec

NAME = "_axon_compare"
"""The run name each candidate trains under (dropped after it)."""


@dataclass
class Comparison:
    """One row per candidate: ``strategy``, ``status`` (``ok`` or why not), ``samples_per_s``,
    ``peak_bytes`` (the largest rank's), ``comm_bytes_per_step`` (the busiest rank's) and
    ``comm_time_share`` (of the step time, rank 0), ``loss`` (the last), and the predictions
    ``predicted_peak_bytes`` and ``predicted_comm_bytes`` (None where there is none, and then
    ``prediction_note`` says why, also in the table's status column); ``peak_phase`` and
    ``predicted_peak_phase``: the phase that held (or is predicted to hold) the peak
    (``forward``, ``backward``, ``step`` or ``pipeline``; None where unknown, as on GPUs),
    and ``peak_by_phase``: the largest rank's most in each phase (forward and backward often
    come within a few percent of each other). A table in the notebook and as text."""

    rows: list[dict[str, Any]] = field(default_factory=list)

    def __str__(self) -> str:
        return text_table(HEAD, [_cells(r) for r in self.rows])

    def _repr_html_(self) -> str:
        return html_table(HEAD, [_cells(r) for r in self.rows])


HEAD = ("strategy", "samples/s", "peak memory", "predicted", "comm/step", "predicted",
        "comm time", "loss", "status")  # fmt: skip


def _cells(r: dict[str, Any]) -> tuple[str, ...]:
    peak = _mib(r.get("predicted_peak_bytes"), 1) + _phase(r.get("predicted_peak_phase"))
    predicted = (peak, _mib(r.get("predicted_comm_bytes"), 2))
    status = "; ".join(s for s in (r["status"], r.get("prediction_note")) if s)
    if r["status"] != "ok":
        return (r["strategy"], "", "", predicted[0], "", predicted[1], "", "", status)
    return (
        r["strategy"], f"{r['samples_per_s']:,.0f}",
        _mib(r["peak_bytes"], 1) + _phase(r.get("peak_phase")), predicted[0],
        _mib(r["comm_bytes_per_step"], 2), predicted[1], f"{100 * r['comm_time_share']:.0f}%",
        f"{r['loss']:.4f}", status,
    )  # fmt: skip


def _phase(phase: str | None) -> str:
    return f" ({phase})" if phase else ""


def _mib(value: float | None, digits: int) -> str:
    return "" if value is None else f"{value / 2**20:,.{digits}f} MiB"


def compare(
    cluster: ClusterLike,
    strategies: list[Any],
    spec: TrainSpec,
    *,
    warmup: int = 2,
    from_state: bool | str = False,
) -> Comparison:
    """Train ``spec`` under each of ``strategies`` for ``spec.steps`` steps: what
    ``cluster.compare(...)`` runs once it has built the spec (with ``resume=bool(from_state)``);
    figures leave out the first ``warmup`` steps.

    ``from_state=True`` (or a run's name; True is ``"model"``): each candidate starts from
    that run's current model, optimizer state, step and schedule, laid out afresh under the
    candidate in memory (``model=`` builds the skeleton), instead of from a fresh model; the
    run itself is left as it is. Its state stays in memory meanwhile, so the peak figures
    include it. Example::

        spec = make_spec(DDP, model=make_model, data=ds, steps=20, batch_size=32)
        compare(cluster, [DDP(), FSDP()], spec)
    """
    from axon_nb.train.start import start_run

    if not strategies:
        raise ValueError("compare needs a list of strategies, e.g. [DDP(), FSDP()]")
    if not isinstance(warmup, int) or not 0 <= warmup < spec.steps:
        raise ValueError(f"warmup must be an integer in 0..steps-1, got {warmup!r}")
    source = "model" if from_state is True else from_state or None
    world = len(cluster.targets())
    profile, not_profiled = _profile(cluster, spec)
    rows = []
    for candidate in strategies:
        strategy = resolve_strategy(candidate)
        row: dict[str, Any] = {"strategy": strategy.describe()}
        row.update(_predicted(profile, strategy, world, cluster.ranks_per_host, spec))
        if not_profiled:
            row["prediction_note"] = not_profiled
        try:
            run = dataclasses.replace(spec, strategy=strategy, name=NAME, resume=bool(source))
            check_world(run, world, cluster.ranks_per_host)
            if source:
                _copy(cluster, source, run)
            label = f"compare {strategy.describe()}"
            result = start_run(cluster, run, show=False, label=label).wait()
            row.update(_figures(result, warmup), status="ok")
        except (ValueError, RankError) as e:
            row["status"] = f"{type(e).__name__}: {e}".splitlines()[0]
        except (RankDiedError, ClusterBrokenError) as e:
            row["status"] = f"{type(e).__name__}: {e}".splitlines()[0]
            cluster.restart()  # the next candidate gets a whole world
        finally:
            if cluster.running:
                cluster.run(entry.drop_run, NAME, stream=False)
        rows.append(row)
    return Comparison(rows)


def _copy(cluster: ClusterLike, source: str, spec: TrainSpec) -> None:
    """Run ``source`` laid out afresh on the ranks as ``spec`` says, under ``spec.name``."""
    cluster.run(entry.copy_run, source, spec)


def _figures(result: Any, warmup: int) -> dict[str, Any]:
    measured = result.history[warmup:]
    step_time = statistics.median(h["step_time_s"] for h in measured)
    comm_time = statistics.median(h["per_rank"]["comm_time_s"][0] for h in measured)
    largest = max(result.memory, key=lambda m: int(m.get("peak_bytes", 0)))
    return {
        "samples_per_s": statistics.median(h["samples_per_s"] for h in measured),
        "peak_bytes": int(largest.get("peak_bytes", 0)),
        "peak_phase": largest.get("peak_phase"),
        "peak_by_phase": largest.get("peak_by_phase", {}),
        "comm_bytes_per_step": max(
            statistics.mean(h["per_rank"]["comm_bytes"][rank] for h in measured)
            for rank in range(len(measured[0]["per_rank"]["comm_bytes"]))
        ),
        "comm_time_share": min(1.0, comm_time / step_time) if step_time else 0.0,
        "loss": result.losses[-1],
    }


def _profile(cluster: ClusterLike, spec: TrainSpec) -> tuple[Any, str | None]:
    """The model's profile (on rank 0) and None, or None and why it could not be taken (a
    stream, a dask collection, a model that does not build): the rows then say why they
    have no predictions."""
    try:
        return cluster.profile(spec.model, spec.data, spec.loss), None
    except (RankError, TypeError, ValueError) as e:
        return None, f"the model could not be profiled: {_first_line(e)}"


def _predicted(
    profile: Any, strategy: Any, world: int, ranks_per_host: int, spec: TrainSpec
) -> dict[str, Any]:
    """The row's predictions, or None for each and ``prediction_note`` saying why."""
    from axon_nb.estimate import predict

    if profile is None:
        return {"predicted_peak_bytes": None, "predicted_comm_bytes": None}  # (no phase)
    try:
        p = predict(
            profile, strategy, world_size=world, batch_size=spec.batch_size,
            ranks_per_host=ranks_per_host, grad_accum=spec.grad_accum, optimizer=spec.optimizer,
            mixed_precision=spec.mixed_precision,
        )  # fmt: skip
    except (KeyError, ValueError) as e:
        return {
            "predicted_peak_bytes": None,
            "predicted_comm_bytes": None,
            "prediction_note": f"no prediction: {_first_line(e)}",
        }
    return {
        "predicted_peak_bytes": p.peak_bytes,
        "predicted_peak_phase": p.peak_phase,
        "predicted_comm_bytes": p.comm_bytes,
    }


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0]
