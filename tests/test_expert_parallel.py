"""Expert parallelism: a mixture-of-experts model's experts split over ranks, tokens sent to
them by all-to-all, equals the model trained in one process (real MPI clusters, gloo): the
reference MoE GPT on 2 ranks (DDP and FSDP for the rest), Hybrid(dp=2, ep=2) and
Hybrid(ep=2, pp=2) on 4, and a tiny random-init transformers Mixtral through its own plan."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from equivalence import check_equal, check_predictions

import axon_nb
from axon_nb import ExpertParallel, Hybrid
from axon_nb.models import GPT, GPTConfig, lm_loss, token_dataset

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

CONFIG = GPTConfig(n_layer=2, n_head=2, experts=4, top_k=2)
ARGS: dict[str, Any] = dict(
    model=lambda: GPT(CONFIG),
    data=token_dataset,
    loss=lm_loss,
    steps=12,
    batch_size=16,
    optimizer=("adamw", {"lr": 3e-3}),
    seed=0,
)
LOSS_TOL = 1e-5
PARAM_TOL = 5e-4


@pytest.fixture(scope="module")
def reference() -> axon_nb.TrainResult:
    return axon_nb.train_local(**ARGS)


def _relative_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


# SGD sees a gradient's scale (AdamW would hide a wrong mean); clipping reads expert norms
# summed over the ranks that hold different experts.
OPTIONS = {"ddp": dict(optimizer=("sgd", {"lr": 0.5})), "fsdp": dict(clip_grad_norm=0.5)}


@pytest.mark.parametrize("data_parallel", ["ddp", "fsdp"])
def test_moe_gpt_under_expert_parallel_equals_one_process(
    pooled_cluster_2: axon_nb.Cluster, data_parallel: str
) -> None:
    args = {**ARGS, **OPTIONS[data_parallel]}
    reference = axon_nb.train_local(**args)
    strategy = ExpertParallel(ep=2, data_parallel=data_parallel)
    result = check_equal(
        pooled_cluster_2,
        reference,
        {**args, "strategy": strategy},
        loss_tol=LOSS_TOL,
        param_tol=PARAM_TOL,
    )
    assert _relative_gap(result.losses, reference.losses) < 1e-5
    # each rank keeps half of every layer's experts: [2, ...] of the [4, ...] weights
    shapes = pooled_cluster_2.run(_local_expert_shapes, stream=False)
    assert shapes == [[2, 2, 2, 2]] * 2
    # every (token, expert) assignment of every step and layer is counted once, by the rank
    # that routed it; the dashboard's snapshot shows the latest step's
    tokens = ARGS["batch_size"] * CONFIG.block_size
    assignments = ARGS["steps"] * CONFIG.n_layer * tokens * CONFIG.top_k
    assert result.expert_tokens is not None and sum(result.expert_tokens) == assignments
    assert len(result.expert_tokens) == CONFIG.experts
    # all-to-all bytes, both ranks: per layer and step the counts (8 bytes per expert, each
    # rank) and every assignment's hidden vector 4 times (there and back, forward and backward)
    per_layer = 2 * 8 * CONFIG.experts + 4 * tokens * CONFIG.top_k * CONFIG.n_embd * 4
    sent = sum(r["comm_totals"]["all_to_all"]["bytes"] for r in result.ranks)
    assert sent == ARGS["steps"] * CONFIG.n_layer * per_layer


def _local_expert_shapes() -> list[int]:
    from axon_nb.rank.training import trainstate

    root = trainstate.get("model").parallel.root
    return [p.to_local().shape[0] for n, p in root.named_parameters() if "experts" in n]


@pytest.mark.parametrize(
    "strategy",
    [
        Hybrid(dp=2, ep=2, data_parallel="ddp"),
        Hybrid(dp=2, ep=2),
        Hybrid(ep=2, pp=2, microbatches=2),
        Hybrid(ep=2, tp=2),
    ],
    ids=["dp2xep2-ddp", "dp2xep2-fsdp", "ep2xpp2", "ep2xtp2"],
)
def test_hybrid_layouts_with_experts_equal_one_process(
    pooled_cluster_4: axon_nb.Cluster, reference: axon_nb.TrainResult, strategy: Hybrid
) -> None:
    check_equal(
        pooled_cluster_4,
        reference,
        {**ARGS, "strategy": strategy},
        loss_tol=LOSS_TOL,
        param_tol=PARAM_TOL,
    )


def test_load_balancing_loss_is_trained_the_same_split_or_not(
    pooled_cluster_2: axon_nb.Cluster,
) -> None:
    """With the auxiliary loss on, each rank balances its own tokens' routing, as DDP does."""
    moe = GPTConfig(n_layer=2, n_head=2, experts=4, top_k=1, aux_loss_coef=0.1)
    args = {**ARGS, "model": lambda: GPT(moe), "loss": None}
    ddp = pooled_cluster_2.train(**args, strategy="ddp")
    ep = pooled_cluster_2.train(**args, strategy=ExpertParallel(ep=2))
    assert _relative_gap(ep.losses, ddp.losses) < 1e-5
    assert ep.losses[-1] < ep.losses[0]


def _transformers_model(name: str) -> Any:
    from hf_models import tiny_mixtral, tiny_qwen_moe

    return {"mixtral": tiny_mixtral, "qwen2_moe": lambda: tiny_qwen_moe(2),
            "qwen3_moe": lambda: tiny_qwen_moe(3)}[name]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "plan"),
    [("mixtral", None), ("mixtral", ("model.layers.*.mlp.experts",)), ("qwen2_moe", None),
     ("qwen3_moe", None)],
    ids=["mixtral-own-plan", "mixtral-user-plan", "qwen2_moe-own-plan", "qwen3_moe-own-plan"],
)  # fmt: skip
def test_tiny_transformers_moe_models_train_under_expert_parallel(
    pooled_cluster_2: axon_nb.Cluster, name: str, plan: Any
) -> None:
    """Random-init transformers MoE models, their own loss on dict batches: through their
    ``base_model_ep_plan`` or a plan naming the experts; each rank holds half the experts."""
    pytest.importorskip("transformers")
    from hf_models import FixedTokens

    run = dict(model=_transformers_model(name), data=FixedTokens(), steps=12, batch_size=8,
               optimizer=("adamw", {"lr": 1e-2}))  # fmt: skip
    result = pooled_cluster_2.train(**run, strategy=ExpertParallel(ep=2, plan=plan))
    assert _relative_gap(result.losses, axon_nb.train_local(**run).losses) < 1e-5
    assert set(pooled_cluster_2.run(_local_expert_shapes, stream=False)[0]) == {2}


def _dense() -> GPT:
    return GPT(GPTConfig(n_layer=2, n_head=2))


def _three_experts() -> GPT:
    return GPT(GPTConfig(n_layer=2, n_head=2, experts=3, top_k=1))


@pytest.mark.parametrize(
    ("model", "strategy", "message"),
    [
        (_dense, ExpertParallel(ep=2), "needs a mixture-of-experts model"),
        (_three_experts, ExpertParallel(ep=2), r"ep=2 does not divide the number of experts \(3"),
        (lambda: GPT(CONFIG), ExpertParallel(ep=2, plan=("blocks.*.moe",)), "matches no module"),
        (lambda: GPT(CONFIG), ExpertParallel(ep=2, plan=("blocks.*.mlp",)), "not an experts"),
    ],
    ids=["dense", "uneven", "plan-names-nothing", "plan-names-a-router"],
)
def test_bad_expert_layouts_are_refused_in_the_kernel(
    pooled_cluster_2: axon_nb.Cluster, model: Any, strategy: ExpertParallel, message: str
) -> None:
    before = pooled_cluster_2.run(_marker, stream=False)
    with pytest.raises(ValueError, match=message):
        pooled_cluster_2.train(**{**ARGS, "model": model, "strategy": strategy})
    assert pooled_cluster_2.run(_marker, stream=False) == before  # nothing ran on the ranks


def _marker() -> int:
    from axon_nb.rank.training import trainstate

    return len(list(trainstate.runs()))


def test_expert_parallel_options_are_checked_when_built() -> None:
    with pytest.raises(ValueError, match="ep must be an integer >= 2"):
        ExpertParallel(ep=1)
    with pytest.raises(ValueError, match="data_parallel must be 'ddp' or 'fsdp'"):
        ExpertParallel(data_parallel="zero2")
    with pytest.raises(ValueError, match="plan must be a tuple of module-name patterns"):
        ExpertParallel(plan="blocks.*")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sequence_parallel with ep > 1 is not supported yet"):
        Hybrid(ep=2, tp=2, sequence_parallel=True)
    with pytest.raises(ValueError, match="multiple of ep"):
        ExpertParallel(ep=4).dims(world_size=2)


def test_grouped_experts_route_each_token_to_its_top_k() -> None:
    """The experts module against a plain per-token loop."""
    from axon_nb.models import MoE

    torch.manual_seed(0)
    moe = MoE(dim=8, num_experts=4, top_k=2)
    x = torch.randn(3, 5, 8)
    probs = torch.softmax(moe.router(x.reshape(-1, 8)), -1)
    weights, index = probs.topk(2, -1)
    weights = weights / weights.sum(-1, keepdim=True)
    expected = torch.stack([
        sum(w * (torch.nn.functional.gelu(t @ moe.experts.up_proj[e]) @ moe.experts.down_proj[e])
            for w, e in zip(ws, es.tolist(), strict=True))
        for t, ws, es in zip(x.reshape(-1, 8), weights, index, strict=True)
    ])  # fmt: skip
    torch.testing.assert_close(moe(x).reshape(-1, 8), expected)
    assert moe.aux_loss is not None and moe.aux_loss.ndim == 0 and moe.aux_loss > 0
    # the last call's loss (part of its graph) stays behind when the model is copied
    assert copy.deepcopy(moe).aux_loss is None and moe.aux_loss is not None


def _state(name: str) -> dict[str, Any]:
    """Run ``name``'s whole model and optimizer state, gathered (rank 0's copy is complete)."""
    from axon_nb.rank.training import trainstate

    state = trainstate.get(name)
    return {"step": state.step, **state.parallel.get_state(state.optimizer, full=True)}


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_checkpoints_move_between_expert_parallel_and_fsdp(
    pooled_cluster_2: axon_nb.Cluster, tmp_path: Any, kind: str
) -> None:
    """Saved with the experts split (ep=2), loaded whole under FSDP, and back: every value
    kept, and the runs go on alike."""
    layouts = [ExpertParallel(ep=2), axon_nb.FSDP()]
    for source, target in (layouts, layouts[::-1]):
        path = tmp_path / f"{source.name}-{kind}"
        pooled_cluster_2.train(**{**ARGS, "steps": 5}, strategy=source, name="a")
        pooled_cluster_2.save(path, kind, name="a")
        saved = pooled_cluster_2.run(_state, "a", stream=False)[0]
        pooled_cluster_2.train(**{**ARGS, "steps": 0}, strategy=target, name="b")
        pooled_cluster_2.load(path, name="b")
        loaded = pooled_cluster_2.run(_state, "b", stream=False)[0]
        assert saved["model"].keys() == loaded["model"].keys()
        for k, v in saved["model"].items():
            assert torch.equal(v, loaded["model"][k]), k
        for name, entry in saved["optimizer"]["state"].items():
            for key, value in entry.items():
                assert torch.equal(value, loaded["optimizer"]["state"][name][key]), (name, key)
        there = pooled_cluster_2.train(
            **{**ARGS, "steps": 4}, strategy=source, name="a", resume=True
        )
        here = pooled_cluster_2.train(
            **{**ARGS, "steps": 4}, strategy=target, name="b", resume=True
        )
        assert _relative_gap(here.losses, there.losses) < 1e-5


HEAD = {"status": "running", "heartbeat": 0, "step": 1, "start_step": 0, "total_steps": 1,
        "elapsed_s": 1.0}  # fmt: skip
"""What every publication carries besides its records (``axon_nb.metrics.stream``)."""


def test_the_dashboard_shows_each_experts_load() -> None:
    from axon_nb.widgets._state import DashboardState
    from axon_nb.widgets.dashboard import Dashboard

    state = DashboardState(world_size=2)
    for rank, routed in ((0, [30, 10, 20, 4]), (1, [26, 6, 12, 20])):
        record = {"step": 1, "loss": 1.0, "rank_loss": 1.0, "samples_per_s": 1.0,
                  "expert_tokens": routed}  # fmt: skip
        state.update(rank, {**HEAD, "records": [record]})
    experts = state.snapshot()["experts"]
    assert experts["total"] == [56, 16, 32, 24] and experts["per_rank"][1] == [26, 6, 12, 20]
    assert experts["imbalance"] == pytest.approx(56 / 32)
    assert DashboardState(world_size=2).snapshot()["experts"] is None  # other strategies
    dashboard = Dashboard(world_size=2)
    for rank, routed in ((0, [30, 10, 20, 4]), (1, [26, 6, 12, 20])):
        record = {"step": 1, "loss": 1.0, "rank_loss": 1.0, "samples_per_s": 1.0,
                  "expert_tokens": routed}  # fmt: skip
        dashboard.message(rank, {**HEAD, "records": [record]})
    dashboard.done({})
    assert dashboard.experts == experts  # the widget's synced trait


def test_predictions_know_expert_parallelism(pooled_cluster_2: axon_nb.Cluster) -> None:
    """Predicted peak memory and communication per step against the ranks' measurement,
    within 5% (``cluster.compare`` puts them side by side), and the advisor proposes it."""
    moe = GPTConfig(n_layer=4, n_embd=64, n_head=4, vocab_size=256, block_size=32, experts=4)
    train = dict(
        model=lambda: GPT(moe),
        data=lambda: token_dataset(256, block_size=32, vocab_size=256),
        loss=lm_loss,
        batch_size=16,
        optimizer=("adamw", {"lr": 1e-3}),
        steps=3,
        warmup=1,
    )
    table = pooled_cluster_2.compare(
        [ExpertParallel(ep=2), ExpertParallel(ep=2, data_parallel="fsdp")], **train
    )
    check_predictions(table, memory_tol=0.05, comm_tol=0.05)
    advice = pooled_cluster_2.advise(train["model"], train["data"], lm_loss, device_memory="1GB",
                                     batch_size=16)  # fmt: skip
    assert any(isinstance(r["strategy"], ExpertParallel) for r in advice.rows)
