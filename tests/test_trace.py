"""``trace=(start_step, steps)``: a Chrome/Perfetto trace per rank of exactly those steps, the
collectives in it by name, a summary table on the kernel; bad steps refused before the run."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

import axon_nb
from axon_nb import DDP, AsyncSGD
from axon_nb.models import GPT, GPTConfig, lm_loss, token_dataset

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

CONFIG = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16)
RUN: dict[str, Any] = dict(
    model=lambda: GPT(CONFIG),
    data=lambda: token_dataset(128, block_size=16, vocab_size=64),
    loss=lm_loss,
    batch_size=16,
    strategy=DDP(),
)


def test_each_rank_traces_only_the_asked_steps(
    pooled_cluster_2: axon_nb.Cluster, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    result = pooled_cluster_2.train(**RUN, steps=6, trace=(3, 2), log_dir=tmp_path)
    assert result.trace_dir is not None and result.trace_dir.startswith(str(tmp_path))
    names = sorted(os.listdir(result.trace_dir))
    assert names == ["rank0.pt.trace.json", "rank1.pt.trace.json"]
    for rank, name in enumerate(names):
        events = json.loads((tmp_path / result.trace_dir / name).read_text())["traceEvents"]
        labels = [str(e.get("name", "")) for e in events]
        # two optimizer steps were traced: steps 3 and 4, no other
        assert sum(label.startswith("Optimizer.step#AdamW.step") for label in labels) == 2
        assert any("all_reduce" in label or "allreduce" in label for label in labels), rank
        summary = result.traces[rank]
        assert summary["steps"] == [3, 4]
        assert summary["top_ops"] and summary["comm_ms"] > 0
        assert 0 < summary["comm_share"] < 1
    printed = capsys.readouterr().out
    assert "compute ms" in printed and "slowest: rank" in printed
    assert len(result.losses) == 6


def test_trace_steps_outside_the_run_are_refused(pooled_cluster_2: axon_nb.Cluster) -> None:
    with pytest.raises(ValueError, match="past this call's 6 steps"):
        pooled_cluster_2.train(**RUN, steps=6, trace=(5, 3))
    with pytest.raises(ValueError, match="the call's first step is 1"):
        pooled_cluster_2.train(**RUN, steps=6, trace=(0, 2))
    with pytest.raises(ValueError, match=r"trace must be \(start_step, steps\)"):
        pooled_cluster_2.train(**RUN, steps=6, trace=3)
    assert pooled_cluster_2.run(lambda: 1) == [1, 1]


def _watch_the_profiler_stop() -> None:
    """(On every rank) record, as each profile stops, whether every all-reduce the loop's
    agreement posted had finished, and that the agreement was settled just before."""
    from torch.profiler import profile

    from axon_nb.parallel.async_sgd import StaleGradients, stale_of
    from axon_nb.rank.training.agreement import StepAgreement

    posted: list[Any] = []
    events: list[str] = []
    post, wait_posted, stop = StepAgreement.post, StepAgreement.wait_posted, profile.__exit__
    wait_sent = StaleGradients.wait_sent

    def recording_post(self: StepAgreement, *args: Any, **kwargs: Any) -> None:
        post(self, *args, **kwargs)
        posted.extend(p.work for p in self._pending if p.work is not None)

    def recording_wait(self: StepAgreement) -> None:
        wait_posted(self)
        events.append("settled")

    def recording_wait_sent(self: StaleGradients) -> None:
        wait_sent(self)
        events.append("gradients in")

    def recording_stop(self: profile, *args: Any) -> Any:
        in_flight = [w for w in posted if not w.is_completed()]
        in_flight += [  # AsyncSGD's gradients on their way
            sent[0]
            for stale in stale_of.values()
            for step in stale.sent
            for sent in step.values()
            if sent[0] is not None and not sent[0].is_completed()
        ]
        events.append("stopped early" if in_flight else "stopped")
        return stop(self, *args)

    StepAgreement.post = recording_post  # type: ignore[method-assign]
    StepAgreement.wait_posted = recording_wait  # type: ignore[method-assign]
    StaleGradients.wait_sent = recording_wait_sent  # type: ignore[method-assign]
    profile.__exit__ = recording_stop  # type: ignore[method-assign]
    _watch_the_profiler_stop.events = events  # type: ignore[attr-defined]
    _watch_the_profiler_stop.undo = lambda: (  # type: ignore[attr-defined]
        setattr(StepAgreement, "post", post),
        setattr(StepAgreement, "wait_posted", wait_posted),
        setattr(StaleGradients, "wait_sent", wait_sent),
        setattr(profile, "__exit__", stop),
    )


def _profiler_stops_seen() -> list[str]:
    watch: Any = _watch_the_profiler_stop
    watch.undo()
    return watch.events


@pytest.mark.parametrize("strategy", [DDP(), AsyncSGD(staleness=2)], ids=str)
def test_the_profiler_stops_only_once_the_steps_collectives_are_in(
    pooled_cluster_2: axon_nb.Cluster, tmp_path: Any, strategy: Any
) -> None:
    """The loop's agreement leaves each step's all-reduce running on gloo's thread (it is
    read a step later), AsyncSGD its last steps' gradients; the profiler is not safe to stop
    while that thread records one."""
    pooled_cluster_2.run(_watch_the_profiler_stop, stream=False)
    try:
        run = {**RUN, "strategy": strategy}
        pooled_cluster_2.train(**run, steps=4, trace=(2, 2), log_dir=tmp_path)
    finally:
        seen = pooled_cluster_2.run(_profiler_stops_seen, stream=False)
    settled = ["settled", "gradients in"] if isinstance(strategy, AsyncSGD) else ["settled"]
    assert seen == [[*settled, "stopped"]] * 2
