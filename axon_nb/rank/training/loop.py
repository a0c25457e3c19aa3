"""The training loop that runs on every rank, start to finish, with no round trip to the kernel.

``train_on_rank`` is what ``cluster.train`` calls on each engine; ``run`` is the loop itself,
also used in one process by ``axon_nb.train_local``. A run is built in ``build.py`` (fresh)
or ``resume.py`` (``resume=True``); the ranks' per-step sums are read as ``agreement.py``
says.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from axon_nb.metrics import memory
from axon_nb.metrics.comm import CommMeter
from axon_nb.metrics.memory import peak_parts
from axon_nb.metrics.peak import PeakTracker, mark_phase
from axon_nb.metrics.stream import MetricsPublisher
from axon_nb.parallel.async_sgd import stale_of
from axon_nb.rank import runtime
from axon_nb.rank.checkpoint.checkpoint_schedule import PeriodicCheckpoints
from axon_nb.rank.observe.step_trace import StepTrace
from axon_nb.rank.training import model_loss, moved_run, trainstate
from axon_nb.rank.training.agreement import PeerFailed, StepAgreement
from axon_nb.rank.training.build import Batches, fresh
from axon_nb.rank.training.evaluation import PeerEvalFailed
from axon_nb.rank.training.micro_step import MicroStep
from axon_nb.rank.training.periodic_eval import PeriodicEval
from axon_nb.rank.training.resume import resume
from axon_nb.rank.training.trainstate import TrainState
from axon_nb.rank.world.interrupts import StopSignal
from axon_nb.spec.train_spec import TrainSpec


def train_on_rank(
    spec: TrainSpec,
    run_id: str,
    stop: StopSignal,
    preempted: Callable[[TrainState], dict[str, Any] | None] | None = None,
) -> dict[str, Any]:
    """Engine entry point: train, stream metrics, return this rank's summary. ``preempted``
    (every rank, when the run stopped) checkpoints it if a preemption notice came, saying
    where, or returns None."""
    from ipyparallel.datapub import publish_data

    from axon_nb.rank.world.kept_runs import keep_end, kept_sink

    sink = kept_sink(publish_data, spec.name, run_id)  # (a detached cluster keeps the run)
    try:
        summary, state = run(spec, runtime.context(), sink=sink, run_id=run_id, stop=stop)
        stopped = summary.get("status") == "stopped"  # (so on every rank)
        if preempted is not None and state is not None and stopped and (said := preempted(state)):
            summary["preempted"] = said
    except BaseException as e:
        import traceback

        keep_end(spec.name, {"error": (type(e).__name__, str(e), traceback.format_exc())})
        raise
    keep_end(spec.name, summary)
    if state is not None:
        trainstate.publish_variable(state)  # the next %%axon cell can evaluate it
    return summary


def run(
    spec: TrainSpec,
    ctx: runtime.RankContext,
    *,
    sink: Any,
    run_id: str,
    stop: StopSignal | None = None,
) -> tuple[dict[str, Any], TrainState | None]:
    """Train on this rank as ``spec`` says; returns this rank's summary and the training state.

    ``stop``: an active :class:`StopSignal` the caller entered earlier (so an interrupt during
    imports before this call counts too); by default one is entered here.

    When another rank fails while setting up, this one returns ``{"aborted": [ranks]}`` and
    no state, so only the failing rank reports an error.
    """
    # The first Ctrl-C during setup waits for setup to end (every rank finishes its
    # collectives) and stops the run at its first step boundary; a second one interrupts.
    with contextlib.nullcontext(stop) if stop is not None else StopSignal() as stop:
        try:
            state, batches, evals = _prepare(spec, ctx)
        except (PeerFailed, PeerEvalFailed) as e:
            return {"rank": ctx.rank, "aborted": e.ranks}, None
        start_step = state.step
        layout_change = next(
            (c for c in reversed(state.layout_changes) if c["step"] == start_step), None
        )
        # from_pretrained returns a model in eval mode: dropout would silently stay off
        state.model.train()
        publisher = MetricsPublisher(
            sink,
            header={
                "run": run_id,
                "name": spec.name,
                "rank": ctx.rank,
                "start_step": start_step,
                "total_steps": start_step + spec.steps,
                "layout_change": layout_change,  # this call moved the run to its strategy
            },
            interval_s=spec.metrics_interval_s,
        )
        loop = _Loop(spec, ctx, state, publisher, run_id)
        loop.evals = evals
        try:
            with loop.meter.installed():
                loop.run(batches, stop)
                if loop.checkpoints is not None:
                    loop.checkpoints.close()
            if loop.trace is not None:  # (a stop inside the traced steps)
                loop.trace.close(settle=loop.quiet)
        except BaseException as e:
            loop.publish("failed", error=f"{type(e).__name__}: {e}")
            raise
        finally:
            if loop.trace is not None:
                loop.trace.close()
    status = "stopped" if loop.stopped else "finished"
    loop.publish(status)
    summary = {
        "rank": ctx.rank,
        "device": str(ctx.device),
        "status": status,
        "start_step": start_step,
        "step": state.step,
        "records": publisher.records,
        "memory": loop.memory,
        "comm_totals": loop.meter.totals(),
        "elapsed_s": time.monotonic() - loop.started,
        "checkpoint": loop.checkpoints.last if loop.checkpoints is not None else None,
        "data_ended_at": loop.data_ended_at,
        "trace": loop.trace.summary if loop.trace is not None else None,
        "layout_change": layout_change,
    }
    return summary, state


def _prepare(
    spec: TrainSpec, ctx: runtime.RankContext
) -> tuple[TrainState, Batches, PeriodicEval | None]:
    """The run's state (fresh or resumed), its data and its evaluations."""
    if spec.resume:
        return resume(spec, ctx)
    moved_run.forget(spec.name)  # (a fresh run replaces one a resize moved)
    return fresh(spec, ctx)


class _Loop:
    """One call's steps: forward/backward via the strategy, optimizer, agreement, metrics."""

    def __init__(
        self,
        spec: TrainSpec,
        ctx: runtime.RankContext,
        state: TrainState,
        publisher: MetricsPublisher,
        run_id: str,
    ) -> None:
        self.spec, self.ctx, self.state, self.publisher = spec, ctx, state, publisher
        self.meter = CommMeter()
        pipelined = state.parallel.pipeline is not None  # (its stages start steps together)
        self.agreement = StepAgreement(ctx.world_size, ctx.device, lockstep=pipelined)
        self.lag = state.parallel.config.lag
        """Steps posted and not read (1; AsyncSGD's ranks may be ``staleness`` steps apart)."""
        self._records: deque[dict[str, Any]] = deque()
        """Metrics of steps whose agreement is not read yet (see ``agreement.py``)."""
        self.micro = MicroStep(spec, ctx, state.scaler, state.module)
        self.evals: PeriodicEval | None = None
        self.trace = None
        if spec.trace is not None:
            log_dir = spec.log_dir or "runs"
            self.trace = StepTrace(
                spec.trace, log_dir=log_dir, run_id=run_id, rank=ctx.rank, device=ctx.device
            )
        self.replicas = state.parallel.dims.dp
        """Data-parallel replicas: gradients are averaged over them."""
        self.stopped = False
        self.data_ended_at: int | None = None
        """The step at which a stream ran out on some rank (every rank stopped there)."""
        self.memory: dict[str, Any] = {}
        self.peak_detail: dict[str, Any] = {}
        """``peak_phase`` and ``peak_parts`` of the tracked step with the highest peak, and
        ``peak_by_phase``: each phase's most over the tracked steps."""
        self.loss_share = state.parallel.dims.loss_share(ctx.rank)
        """Weight of this rank's loss in the global mean; 0 on a pipeline's earlier stages."""
        self.peak_bytes: int | None = None
        """CPU: peak tensor bytes of this call's first and third steps (see metrics.peak)."""
        self._steps_taken = 0
        self.started = time.monotonic()
        self._clock = time.perf_counter()  # where the last step's time was taken
        self._first_step = state.step
        self.reported_step = state.step
        """The newest step whose record is complete (its agreement read): what ``publish``
        reports, so progress and the records agree."""
        self.checkpoints: PeriodicCheckpoints | None = None
        if spec.checkpoint_dir is not None:
            self.checkpoints = PeriodicCheckpoints(
                spec.checkpoint_dir,
                steps=spec.checkpoint_every,
                seconds=spec.checkpoint_every_s,
                keep=spec.keep,
                ctx=ctx,
                run_id=run_id,
            )

    def quiet(self) -> None:
        """Wait for the collectives a step leaves running (the agreement's sums, AsyncSGD's
        gradients on their way): the profiler is not safe to stop while gloo's thread
        records one."""
        self.agreement.wait_posted()
        stale = stale_of.get(self.state.model)
        if stale is not None:
            stale.wait_sent()

    def run(self, batches: Batches, stop: StopSignal) -> None:
        # Step times tile the run (each from where the previous one's was taken): they include
        # loading data, reading agreements and publishing metrics. samples/s is end to end.
        self._clock = time.perf_counter()
        for i, microbatches in zip(
            range(self.spec.steps), batches.on_device(self.state.step), strict=False
        ):
            if self.trace is not None:
                self.trace.before(i + 1)
            self.step(microbatches, stop, last=i == self.spec.steps - 1)
            if self.trace is not None:
                self.trace.after(i + 1, settle=self.quiet)
            if self.stopped:
                return
        # Only a stream ends before the last step (every rank at the same one).
        self.data_ended_at = getattr(batches, "ended_at", None)
        if len(self.agreement):
            self.stopped = self._settle(keep=0)[0]
        if self.data_ended_at is not None and self.data_ended_at == self._first_step:
            per_rank = self.spec.batch_size // self.state.parallel.dims.dp
            raise ValueError(
                f"the data gave no complete step: each data-parallel rank needs {per_rank} "
                "items per step (batch_size / data-parallel ranks); use a smaller batch_size "
                "or more data"
            )

    def _note_peak(self, tracker: PeakTracker, held: dict[str, int]) -> None:
        """Keep a tracked step's peak if it is the highest yet, and each phase's most."""
        state, at_start = self.state, sum(held.values())
        by_phase = dict(self.peak_detail.get("peak_by_phase", {}))
        for phase, nbytes in tracker.phase_peaks.items():
            by_phase[phase] = max(by_phase.get(phase, 0), at_start + nbytes)
        if at_start + tracker.peak > (self.peak_bytes or 0):
            self.peak_bytes = at_start + tracker.peak
            self.peak_detail = peak_parts(tracker, held, state.model, state.optimizer)
        self.peak_detail["peak_by_phase"] = by_phase
        tracker.close()

    def step(self, microbatches: list[Any], stop: StopSignal, *, last: bool) -> None:
        spec, state = self.spec, self.state
        lr = state.optimizer.param_groups[0]["lr"]
        # torch.compile does not trace under the tracker's dispatch mode (and would then
        # leave the blocks uncompiled for good): compiled runs report no CPU peak.
        # The first step creates the optimizer state; the third is a steady one (in the second
        # DDP rebuilds its buckets, freeing the old ones where the tracker cannot see it).
        self._steps_taken += 1
        track = self._steps_taken in (1, 3) and self.ctx.device.type == "cpu" and not spec.compile
        if track:
            held = memory.held_parts(state.model, state.optimizer)
        with PeakTracker() if track else contextlib.nullcontext() as tracker:
            loss, norm = self._update(microbatches)
        if tracker is not None:
            self._note_peak(tracker, held)
        publish = last or self.publisher.due()
        if publish:  # before zero_grad, so gradients count
            self.memory = memory.snapshot(
                state.model, state.optimizer, self.ctx.device, self.peak_bytes
            )
            self.memory.update(self.peak_detail)
        state.optimizer.zero_grad(set_to_none=True)
        state.scheduler.step()
        state.step += 1
        every = self.checkpoints
        written, time_due = (every.written(), every.time_due()) if every else (False, False)
        self._post(loss, norm, flags=(stop.requested, written, time_due))
        now = time.perf_counter()
        elapsed, self._clock = now - self._clock, now
        comm = self.meter.take()
        self._records.append(
            {
                **(self.evals.after_step(state.step, self.meter) if self.evals else {}),
                "step": state.step,
                "lr": lr,
                "samples": spec.batch_size,
                "step_time_s": elapsed,
                "samples_per_s": spec.batch_size / elapsed,
                "comm": comm,
                "comm_bytes": sum(int(c["bytes"]) for c in comm.values()),
                "comm_time_s": sum(c["time_s"] for c in comm.values()),
                **state.parallel.report(),
            }
        )
        # Read the previous step's agreement (this one's too at the end, or to stop): every
        # rank reads the same sums at the same boundary, so all stop at the same step.
        stops, all_written, due = self._settle(keep=0 if last else self.lag)
        if stops and not last:
            more = self._settle(keep=0)
            stops, all_written, due = True, more[1], due or more[2]
        self.stopped = stops
        if every is not None:
            every.after_agreement(all_written, due, state, last=last or self.stopped)
        if publish and not (last or self.stopped):
            self.publish("running")

    def _post(self, loss: torch.Tensor, norm: torch.Tensor | None, flags: tuple[bool, ...]) -> None:
        """Start this step's sum over the ranks: the loss weighted by this rank's share of the
        global mean, and ``flags`` (stop requested, checkpoint written, checkpoint due)."""
        share = self.loss_share
        if self.spec.loss_normalization == "tokens":  # ``loss`` is already a share of the mean
            share *= self.replicas
        device = loss.device
        if device.type == "cpu":  # read at once (nothing to wait for): one tensor, no kernels
            value = loss.item()
            own = [value, math.nan if norm is None else norm.float().item()]
            self.agreement.post(torch.tensor([value * share, *map(float, flags)]), local=own)
            return
        flag_values = torch.tensor([float(f) for f in flags])
        if device.type == "cuda":  # pinned, so the copy queues without waiting for the GPU
            flag_values = flag_values.pin_memory()
        flag_values = flag_values.to(device, non_blocking=True)
        loss = loss.float().reshape(1)
        missing = torch.full((1,), float("nan"), device=device)
        local = torch.cat([loss, missing if norm is None else norm.float().reshape(1)])
        self.agreement.post(torch.cat([loss * share, flag_values]), local=local)

    def _settle(self, keep: int) -> tuple[bool, bool, bool]:
        """Read the agreements of all but the ``keep`` newest steps, completing and streaming
        their metrics; returns (any rank asked to stop, every rank's checkpoint write was done
        at the newest of them, a time-based checkpoint was due at any of them)."""
        stops = written = due = False
        while len(self.agreement) > keep:
            (total, stop, all_written, time_due), (rank_loss, norm) = self.agreement.take()
            record = self._records.popleft()
            record["loss"] = total
            record["rank_loss"] = rank_loss if self.loss_share else None
            record["grad_norm"] = None if math.isnan(norm) else norm
            self.publisher.add(record)
            self.reported_step = record["step"]
            stops = stops or stop > 0
            written = all_written == self.ctx.world_size
            due = due or time_due > 0
        return stops, written, due

    def _update(self, microbatches: list[Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Forward, backward, clipping and the optimizer step; the loss and gradient norm."""
        spec, state = self.spec, self.state
        loss = self._forward_backward(microbatches)
        mark_phase("step")
        state.parallel.reduce_expert_grads()
        if state.scaler is not None:
            state.scaler.unscale_(state.optimizer)
        norm = None
        if spec.clip_grad_norm is not None:  # a tensor, read with the step's agreement
            norm = state.parallel.clip_grad_norm(spec.clip_grad_norm).detach()
        if state.scaler is not None:
            state.scaler.step(state.optimizer)
            state.scaler.update()
        else:
            state.optimizer.step()
        return loss, norm

    def _forward_backward(self, microbatches: list[Any]) -> torch.Tensor:
        """Forward and backward over one step's micro-batches; their mean loss (detached).

        Gradients are averaged over micro-batches; only the last one synchronises them.
        """
        parallel = self.state.parallel
        if parallel.pipeline is not None:
            mark_phase("pipeline")  # forward and backward interleaved by the schedule
            return parallel.pipeline.step(microbatches, self.micro)
        num_items, weight = None, 1.0 / len(microbatches)
        if self.spec.loss_normalization == "tokens":
            # each micro-batch's loss comes as its share of the global token mean; the
            # gradients' mean over the replicas is undone so that the shares add up
            num_items, weight = self._global_targets(microbatches), float(self.replicas)
        total = torch.zeros((), device=self.ctx.device)
        for i, batch in enumerate(microbatches):
            last = i == len(microbatches) - 1
            with contextlib.nullcontext() if last else parallel.no_sync():
                mark_phase("forward")
                loss = self.micro.loss(parallel.model, batch, num_items)
                mark_phase("backward")
                self.micro.backward(loss * weight)
            total = total + loss.detach()
        parallel.finish_backward()
        return total if num_items is not None else total / len(microbatches)

    def _global_targets(self, microbatches: list[Any]) -> torch.Tensor:
        """Target tokens (labels not -100) in the step's global batch: this rank's, summed over
        the ranks, divided by the ranks that read the same data (tensor-parallel peers)."""
        rule = self.micro.rule
        local = sum(model_loss.count_targets(b, rule.shifts_labels) for b in microbatches)
        count = torch.as_tensor(local, device=self.ctx.device).reshape(1).clone()
        if self.ctx.world_size > 1:
            dist.all_reduce(count)
            count = count // (self.ctx.world_size // self.replicas)
        return count.clamp_min(1).reshape(())

    def publish(self, status: str, **fields: Any) -> None:
        if self.checkpoints is not None:
            fields["checkpoint"] = self.checkpoints.last
        self.publisher.publish(
            status,
            step=self.reported_step,  # the last step whose record is complete
            elapsed_s=time.monotonic() - self.started,
            memory=self.memory,
            comm_totals=self.meter.totals(),
            **fields,
        )
