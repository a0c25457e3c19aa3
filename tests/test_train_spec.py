"""Training arguments, schedule, stream and result building: no cluster needed."""

from __future__ import annotations

import math
import time

import pytest

import axon_nb
from axon_nb.metrics import stream
from axon_nb.metrics.stream import RESEND_S, SCHEMA, MetricsPublisher
from axon_nb.spec.make import make_spec
from axon_nb.spec.validation import check_world
from axon_nb.strategies import DDP, SingleDevice
from axon_nb.train.result import merge_records

BASE = dict(model=object(), data=object(), steps=10, batch_size=32)


def test_unknown_optimizer_and_strategy_names_are_rejected_with_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown optimizer 'adamz'.*adamw"):
        make_spec(DDP, **BASE, optimizer=("adamz", {}))
    with pytest.raises(ValueError, match=r"unknown strategy 'fsdb'.*ddp"):
        make_spec(DDP, **BASE, strategy="fsdb")
    assert make_spec(DDP, **BASE, strategy="DDP").strategy == DDP()
    assert make_spec(SingleDevice, **BASE).strategy == SingleDevice()


def test_batch_size_must_split_evenly_over_ranks_and_micro_batches() -> None:
    spec = make_spec(DDP, **{**BASE, "batch_size": 30}, grad_accum=2)
    with pytest.raises(ValueError, match=r"batch_size=30 .* 4 x 2 = 8 .* batch_size=24 or 32"):
        check_world(spec, 4)
    check_world(make_spec(DDP, **BASE, grad_accum=2), 4)  # 32 = 4 ranks x 2 x 4


def test_every_bad_argument_is_listed_at_once() -> None:
    with pytest.raises(ValueError) as e:
        make_spec(
            DDP,
            **{**BASE, "steps": -1},
            mixed_precision="fp8",
            schedule="step",
            name="my model",
            clip_grad_norm=-1.0,
        )
    text = str(e.value)
    for part in ("steps must be", "mixed_precision", "schedule must", "name must", "clip_grad"):
        assert part in text


def test_ddp_options_are_checked() -> None:
    with pytest.raises(ValueError, match="comm_hook must be None, 'fp16', 'bf16' or 'powersgd'"):
        DDP(comm_hook="int8")
    with pytest.raises(ValueError, match="powersgd_rank"):
        DDP(comm_hook="powersgd", powersgd_rank=0)


def test_learning_rate_warms_up_then_decays() -> None:
    from axon_nb.rank.training.trainstate import LRShape

    cosine = LRShape(warmup_steps=4, horizon=14, shape="cosine")
    assert [cosine(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert cosine(9) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert cosine(14) == pytest.approx(0.0)
    assert LRShape(warmup_steps=0, horizon=10, shape="linear")(5) == 0.5
    assert LRShape(warmup_steps=0, horizon=10)(7) == 1.0


def test_publisher_throttles_and_repeats_the_recent_records(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sent: list[dict] = []
    pub = MetricsPublisher(sent.append, header={"rank": 0}, interval_s=3600)
    assert pub.due()
    pub.add({"step": 1})
    pub.publish(step=1)
    assert not pub.due()  # throttled: the next one waits for the interval
    pub.add({"step": 2})
    pub.publish(step=2)
    pub.add({"step": 3})
    pub.publish("finished", step=3)
    assert [m["status"] for m in sent] == ["running", "running", "finished"]
    # the kernel reads only the latest publication: each repeats those of the last RESEND_S
    assert [[r["step"] for r in m["records"]] for m in sent] == [[1], [1, 2], [1, 2, 3]]
    assert sent[0]["schema"] == SCHEMA and sent[0]["rank"] == 0
    assert [r["step"] for r in pub.records] == [1, 2, 3]
    off = MetricsPublisher(sent.append, header={}, interval_s=0)
    off.publish()
    assert len(sent) == 3 and not off.due()
    # older publications are not repeated, except the previous one
    later = time.monotonic() + 2 * RESEND_S
    monkeypatch.setattr(stream.time, "monotonic", lambda: later)
    pub.add({"step": 4})
    pub.publish(step=4)
    assert [r["step"] for r in sent[-1]["records"]] == [3, 4]


def test_history_merges_ranks_and_keeps_per_rank_figures() -> None:
    def rec(step: int, loss: float, t: float) -> dict:
        return {
            "step": step, "loss": 1.0, "rank_loss": loss, "lr": 0.1, "grad_norm": None,
            "samples": 8, "step_time_s": t, "samples_per_s": 8 / t, "comm": {},
            "comm_bytes": 4, "comm_time_s": 0.0,
        }  # fmt: skip

    history = merge_records({0: {1: rec(1, 0.9, 0.1)}, 1: {1: rec(1, 1.1, 0.2), 2: rec(2, 1, 1)}})
    assert [h["step"] for h in history] == [1, 2]
    assert history[0]["per_rank"]["loss"] == [0.9, 1.1]
    assert history[0]["step_time_s"] == 0.2  # the slowest rank sets the pace
    assert history[1]["per_rank"]["loss"] == [None, 1]


def test_kernel_side_training_api_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, axon_nb; from axon_nb import DDP, train_local; "
        "import axon_nb.train.handle; DDP(comm_hook='bf16'); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert axon_nb.TrainResult is not None


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("rank", "would replace the ranks' predefined 'rank'"),
        ("world_size", "would replace the ranks' predefined 'world_size'"),
        ("device", "would replace the ranks' predefined 'device'"),
        ("torch", "would shadow the module cells usually import as 'torch'"),
        ("dist", "would shadow the module cells usually import as 'dist'"),
        ("np", "would shadow the module cells usually import as 'np'"),
        ("print", "would shadow the Python builtin 'print'"),
        ("len", "would shadow the Python builtin 'len'"),
        ("class", "is a Python keyword"),
        ("my model", "must be a Python identifier"),
    ],
)
def test_run_names_that_would_shadow_the_ranks_names_are_refused(name: str, why: str) -> None:
    with pytest.raises(ValueError) as e:
        make_spec(DDP, **BASE, name=name)
    assert why in str(e.value)
    if name.isidentifier():
        assert 'e.g. name="model"' in str(e.value)


def test_ordinary_run_names_are_accepted() -> None:
    for name in ("model", "gpt", "a", "student_2", "net"):
        assert make_spec(DDP, **BASE, name=name).name == name
