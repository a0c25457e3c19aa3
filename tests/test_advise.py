"""``axon_nb.advise``: candidates ranked by predicted step time with memory per rank, whether
each fits and why; a probe of the model in a subprocess (the kernel never imports torch);
bad input refused with what to do."""

from __future__ import annotations

import functools

import pytest

import axon_nb
from axon_nb import DDP, FSDP, AsyncSGD, DiLoCo, Hybrid, TensorParallel, ZeRO, estimate
from axon_nb.cluster.bandwidth import BandwidthReport
from axon_nb.estimate import LayerProfile, ModelProfile
from axon_nb.models import GPT, GPTConfig, lm_loss, token_dataset

pytestmark = pytest.mark.timeout(120)

CONFIG = GPTConfig(n_layer=4, n_embd=64, n_head=4, vocab_size=256, block_size=32)
MAKE_GPT = functools.partial(GPT, CONFIG)
# 10M parameters in 10 blocks; 1 KiB of activations per sample per block
BLOCK = dict(params=1_000_000, tp_params=990_000, block=True, saved_bytes=1024, output_bytes=64)
BIG = ModelProfile(
    layers=tuple(LayerProfile(name=f"blocks.{i}", **BLOCK) for i in range(10)), flops=6e7
)


@pytest.fixture(scope="module")
def gpt_profile() -> ModelProfile:
    return estimate.profile(MAKE_GPT, functools.partial(token_dataset, 64), lm_loss)


def test_profile_in_a_subprocess_measures_the_model(gpt_profile: ModelProfile) -> None:
    model = MAKE_GPT()
    assert gpt_profile.params == sum(p.numel() for p in model.parameters())
    assert [layer.name for layer in gpt_profile.layers][1:-1] == [f"blocks.{i}" for i in range(4)]
    block = gpt_profile.layers[1]
    assert block.block and 0.5 < block.split_fraction < 1  # q/k/v and MLP outputs split
    assert block.colwise_in_bytes == 4 * block.output_bytes  # q, k, v and up read the stream
    assert gpt_profile.flops == 6 * gpt_profile.params * CONFIG.block_size
    # the reference GPT needs no data: random tokens
    assert estimate.profile(MAKE_GPT).params == gpt_profile.params


def test_short_memory_ranks_sharding_first_and_says_why() -> None:
    advice = axon_nb.advise(profile=BIG, world_size=8, device_memory="100MB", batch_size=32)
    rows = {r["name"]: r for r in advice.rows}
    ddp = rows["DDP()"]
    assert not ddp["fits"] and ddp["reason"].startswith("does not fit: ")
    assert "replicates the model" in ddp["reason"]
    assert type(advice.best) in (FSDP, Hybrid, TensorParallel)  # parameters split
    assert advice.rows[0]["fits"] and advice.rows[0]["rank"] == 1
    fitting = [r["step_s"] for r in advice.rows if r.get("fits")]
    assert fitting == sorted(fitting)
    assert "shards parameters" in rows["FSDP()"]["reason"]
    assert str(advice).splitlines()[0].split()[:3] == ["#", "strategy", "fits"]
    assert "<table>" in advice._repr_html_()


def test_plenty_of_memory_and_slow_links_prefers_replication() -> None:
    advice = axon_nb.advise(profile=BIG, world_size=8, device_memory="80GiB", batch_size=64,
                            bandwidth={"intra_host": 1e9, "inter_host": 1e9},
                            strategies=[FSDP(), DDP(), ZeRO(stage=1)])  # fmt: skip
    assert advice.rows[0]["name"] == "DDP()"  # least traffic, everything fits
    assert all(r["fits"] for r in advice.rows)


def test_measured_bandwidth_is_used() -> None:
    def report(busbw: float) -> BandwidthReport:
        return BandwidthReport([{"collective": "all_reduce", "axis": "world", "ranks": 8,
                                 "bytes": 2**26, "time_s": 1.0, "algbw": busbw,
                                 "busbw": busbw}])  # fmt: skip

    kwargs = dict(profile=BIG, world_size=8, device_memory="80GB", strategies=[DDP()])
    fast = axon_nb.advise(bandwidth=report(100e9), **kwargs).rows[0]["step_s"]
    slow = axon_nb.advise(bandwidth=report(1e9), **kwargs).rows[0]["step_s"]
    assert slow > 5 * fast


def test_bad_input_is_refused_or_reported_in_its_row() -> None:
    with pytest.raises(ValueError, match="device_memory must be a size such as '80GB'"):
        axon_nb.advise(profile=BIG, world_size=8, device_memory="lots")
    with pytest.raises(ValueError, match="hosts must be a positive integer that divides"):
        axon_nb.advise(profile=BIG, world_size=8, device_memory="80GB", hosts=3)
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        axon_nb.advise(profile=BIG, world_size=0, device_memory="80GB")
    with pytest.raises(ValueError, match="no optimizer-state size for optimizer 'lion'"):
        axon_nb.advise(profile=BIG, world_size=2, device_memory="80GB", optimizer="lion",
                       strategies=[DDP()])  # fmt: skip
    with pytest.raises(ValueError, match="bandwidth as a dict needs 'intra_host'"):
        axon_nb.advise(profile=BIG, world_size=2, device_memory="80GB", bandwidth={"x": 1})
    with pytest.raises(TypeError, match="pass data="):
        estimate.profile(lambda: __import__("torch").nn.Linear(2, 2))
    advice = axon_nb.advise(profile=BIG, world_size=8, device_memory="80GB",
                            strategies=[Hybrid(dp=3, tp=2), DDP()])  # fmt: skip
    bad = advice.rows[-1]
    assert bad["status"].startswith("cannot run: the parallel degrees must multiply")
    assert advice.rows[0]["name"] == "DDP()"
    assert "cannot run" in str(advice)


def test_cpu_offload_leaves_the_shards_out_of_device_memory() -> None:
    kept = estimate.predict(BIG, FSDP(), world_size=4, batch_size=8).ranks[0]["memory"]
    offloaded = estimate.predict(BIG, FSDP(cpu_offload=True), world_size=4,
                                 batch_size=8).ranks[0]["memory"]  # fmt: skip
    # fp32 Adam, sharded over 4: parameters, gradients (which FSDP makes after the peak, on the
    # device when kept there) and optimizer state go to the host
    assert kept["grads"] == 0
    assert offloaded["offloaded"] == pytest.approx(16 * BIG.params / 4)
    on_device = kept["params"] + kept["optimizer"]
    assert offloaded["peak"] == pytest.approx(kept["peak"] - on_device)


def test_activation_checkpointing_and_mixed_precision_shrink_activations() -> None:
    def activations(strategy: object, **kwargs: object) -> float:
        p = estimate.predict(BIG, strategy, world_size=2, batch_size=8, **kwargs)
        return p.ranks[0]["memory"]["activations"]

    full = activations(DDP())
    assert full == pytest.approx(10 * 1024 * 4)  # 10 blocks, 4 samples a rank
    assert activations(DDP(), mixed_precision="bf16") == pytest.approx(full / 2)
    # checkpointed: each block keeps its input (64 B a sample), one block is rebuilt at a time
    assert activations(DDP(activation_checkpointing=True)) == pytest.approx((9 * 64 + 1024) * 4)


def test_slow_links_rank_asyncsgd_and_diloco_by_what_their_communication_costs() -> None:
    """AsyncSGD's all-reduce hides behind the whole step (DDP's behind backward); DiLoCo's,
    a ``inner_steps``-th of DDP's, is in the optimizer's step, hidden by nothing."""
    slow = dict(profile=BIG, world_size=8, device_memory="80GiB", batch_size=64,
                bandwidth={"intra_host": 1e9, "inter_host": 1e9})  # fmt: skip
    strategies = [DDP(), AsyncSGD(staleness=4), DiLoCo(inner_steps=100)]
    rows = {r["name"]: r for r in axon_nb.advise(**slow, strategies=strategies).rows}
    ddp, stale, diloco = (rows[s.describe()] for s in strategies)
    assert stale["comm_bytes"] == ddp["comm_bytes"] and stale["step_s"] < ddp["step_s"]
    assert diloco["comm_bytes"] < ddp["comm_bytes"] / 50 and diloco["step_s"] < ddp["step_s"]
    assert axon_nb.advise(**slow, strategies=strategies).rows[0]["name"] == diloco["name"]
