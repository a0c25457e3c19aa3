"""``model=axon_nb.pretrained(cls, path)``: the model is built with its parameters on the meta
device, laid out, and each rank reads only its own part of the safetensors files. Runs equal
``train_local`` of ``from_pretrained``; a host holds about one copy of the weights while FSDP
starts, against one per rank for ``model=lambda: from_pretrained(path)``. Checkpoints are
written with ``save_pretrained`` to temporary directories (nothing is downloaded)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_models import TokenRows, hf_rows, pad, tiny_llama

import axon_nb
from axon_nb import DDP, FSDP, Hybrid, Pipeline, TensorParallel

pytest.importorskip("transformers")
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

STEPS = 12
SAVED_SEED = 123
"""The saved weights' seed: not the runs' (0), so a run that ignored them could not match."""
RUN: dict[str, Any] = dict(
    data=TokenRows(), loss_normalization="tokens", steps=STEPS, batch_size=8,
    loader={"collate_fn": pad},
    optimizer=("adamw", {"lr": 1e-2}),
)  # fmt: skip


def _save_llama(path: Path, *, tied: bool = False, shards: bool = False) -> Path:
    """A tiny Llama saved with ``save_pretrained``: with tied embeddings, in several files."""
    from transformers import LlamaForCausalLM

    config = tiny_llama().config
    config.tie_word_embeddings = tied
    torch.manual_seed(SAVED_SEED)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # logits far from uniform: a random start's loss is not near it
        for head in {model.lm_head.weight, model.model.embed_tokens.weight}:  # one when tied
            head.mul_(10)
    model.save_pretrained(path, **({"max_shard_size": "20KB"} if shards else {}))
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Checkpoints by kind: plain, tied embeddings, sharded into several files."""
    root = tmp_path_factory.mktemp("pretrained")
    return {
        "plain": _save_llama(root / "plain"),
        "tied": _save_llama(root / "tied", tied=True),
        "sharded": _save_llama(root / "sharded", shards=True),
    }


def _from_pretrained(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return lambda: AutoModelForCausalLM.from_pretrained(path)


def _assert_same_losses(got: list[float], want: list[float], rel: float = 1e-5) -> None:
    assert len(got) == len(want) == STEPS
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))
    assert worst < rel, (worst, got, want)


def test_a_block_is_read_as_slicing_the_tensor(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from axon_nb.rank.checkpoint.safetensors_slices import SafetensorsFiles

    tensors = {
        "a": torch.randn(7, 5, 3), "b": torch.randn(4, 9).bfloat16(),
        "scalar": torch.tensor(3.5), "mask": torch.rand(6) > 0.5,
    }  # fmt: skip
    save_file({k: tensors[k] for k in ("a", "b")}, tmp_path / "one.safetensors")
    save_file({k: tensors[k] for k in ("scalar", "mask")}, tmp_path / "two.safetensors")
    files = SafetensorsFiles([str(tmp_path / "one.safetensors"), str(tmp_path / "two.safetensors")])
    rng = random.Random(0)
    for name, tensor in tensors.items():
        for _ in range(30):
            offset = [rng.randrange(n) for n in tensor.shape]
            shape = [rng.randint(0, n - o) for n, o in zip(tensor.shape, offset, strict=True)]
            wider = torch.float64 if tensor.is_floating_point() else tensor.dtype
            for dtype in {tensor.dtype, wider}:
                out = torch.empty(shape, dtype=dtype)
                files.read_into(name, out, offset)
                block = tensor[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
                assert torch.equal(out, block.to(dtype)), (name, offset, shape)
    with pytest.raises(ValueError, match="outside a tensor"):
        files.read_into("a", torch.empty(2, 5, 3), (6, 0, 0))


def test_the_model_is_what_from_pretrained_gives(saved: dict[str, Path]) -> None:
    """Built on meta and read (no layout): sharded files, tied embeddings, a checkpoint of a
    model with a head read into its base model, from_pretrained's dtype option."""
    from transformers import AutoModel, AutoModelForCausalLM

    from axon_nb.rank.training import meta_init

    assert len(list(saved["sharded"].glob("*.safetensors"))) > 1
    cases = [
        (AutoModelForCausalLM, saved["sharded"], {}),
        (AutoModelForCausalLM, saved["tied"], {}),
        (AutoModel, saved["plain"], {}),  # keys "model.layers..." into LlamaModel's "layers..."
        ("AutoModelForCausalLM", saved["plain"], {"dtype": torch.bfloat16}),
    ]
    for cls, path, options in cases:
        model = meta_init.load_whole(axon_nb.pretrained(cls, path, **options))
        named = cls if isinstance(cls, type) else AutoModelForCausalLM
        want = named.from_pretrained(path, **options)
        assert type(model) is type(want)
        got = model.state_dict()
        assert got.keys() == want.state_dict().keys()
        for key, value in want.state_dict().items():
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), (path, key)
    tied = meta_init.load_whole(axon_nb.pretrained(AutoModelForCausalLM, saved["tied"]))
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


@pytest.fixture(scope="module")
def reference(saved: dict[str, Path]) -> dict[str, axon_nb.TrainResult]:
    """``train_local`` of ``from_pretrained`` (and of a random start, which runs must not equal)."""
    return {
        "plain": axon_nb.train_local(model=_from_pretrained(saved["plain"]), **RUN),
        "tied": axon_nb.train_local(model=_from_pretrained(saved["tied"]), **RUN),
        "random": axon_nb.train_local(model=tiny_llama, **{**RUN, "steps": 1}),
    }


@pytest.mark.parametrize(
    ("kind", "strategy"),
    [
        ("plain", FSDP()),
        ("plain", TensorParallel(plan="auto")),
        ("plain", DDP()),
        ("tied", FSDP()),
    ],
    ids=["fsdp", "tp", "ddp", "fsdp-tied"],
)
def test_a_layout_trains_as_from_pretrained_in_one_process(
    pooled_cluster_2: axon_nb.Cluster,
    saved: dict[str, Path],
    reference: dict[str, axon_nb.TrainResult],
    kind: str,
    strategy: Any,
) -> None:
    from transformers import AutoModelForCausalLM

    model = axon_nb.pretrained(AutoModelForCausalLM, saved[kind])
    result = pooled_cluster_2.train(model=model, strategy=strategy, **RUN)
    _assert_same_losses(result.losses, reference[kind].losses)
    # the weights were read: a random start (the run's seed) has another first loss
    assert abs(result.losses[0] - reference["random"].losses[0]) > 1e-2
    if kind == "tied":
        assert pooled_cluster_2.run(_tied) == [True, True]


def _tied() -> bool:
    from axon_nb.rank.training import trainstate

    root = trainstate.get("model").parallel.root
    return root.lm_head.weight is root.model.embed_tokens.weight


def test_fsdp_over_tensor_parallel_reads_each_ranks_block(
    pooled_cluster_4: axon_nb.Cluster,
    saved: dict[str, Path],
    reference: dict[str, axon_nb.TrainResult],
) -> None:
    """Two dimensions: each weight is split by tensor parallelism, then sharded by FSDP."""
    from transformers import AutoModelForCausalLM

    model = axon_nb.pretrained(AutoModelForCausalLM, saved["plain"])
    result = pooled_cluster_4.train(model=model, strategy=Hybrid(dp=2, tp=2, plan="auto"), **RUN)
    _assert_same_losses(result.losses, reference["plain"].losses)


def _gpt() -> Any:
    from axon_nb.models import GPT, GPTConfig

    return GPT(GPTConfig(n_layer=4, n_head=2))


@pytest.mark.parametrize("form", ["torch", "llama"])
def test_a_pipeline_reads_only_its_stages(
    pooled_cluster_2: axon_nb.Cluster, saved: dict[str, Path], tmp_path: Path, form: str
) -> None:
    from safetensors.torch import save_model

    from axon_nb.models import lm_loss, token_dataset

    if form == "torch":  # any torch model with a pipeline, from a file of its state_dict
        torch.manual_seed(SAVED_SEED)
        save_model(_gpt(), str(tmp_path / "gpt.safetensors"))
        model = axon_nb.pretrained(_gpt, tmp_path / "gpt.safetensors")
        build, random_start = _loaded_gpt(tmp_path), _gpt
        run = dict(data=token_dataset, loss=lm_loss, steps=STEPS, batch_size=16)
    else:
        from transformers import AutoModelForCausalLM

        model = axon_nb.pretrained(AutoModelForCausalLM, saved["plain"])
        build, random_start = _from_pretrained(saved["plain"]), tiny_llama
        run = dict(data=hf_rows(), steps=STEPS, batch_size=8, optimizer=("adamw", {"lr": 1e-2}))
    reference = axon_nb.train_local(model=build, **run)
    result = pooled_cluster_2.train(model=model, strategy=Pipeline(microbatches=2), **run)
    _assert_same_losses(result.losses, reference.losses)
    random = axon_nb.train_local(model=random_start, **{**run, "steps": 1})
    assert abs(result.losses[0] - random.losses[0]) > 1e-2
    total = sum(p.numel() * 4 for p in reference.model.parameters())
    held = [m["param_bytes"] for m in result.memory]
    assert sum(held) == total and max(held) < 0.8 * total


def _loaded_gpt(tmp_path: Path) -> Any:
    def build() -> Any:
        from safetensors.torch import load_model

        model = _gpt()
        load_model(model, str(tmp_path / "gpt.safetensors"))
        return model

    return build


def test_bad_input_is_refused_with_what_to_do(
    pooled_cluster_2: axon_nb.Cluster, saved: dict[str, Path], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    # on the kernel, at once
    with pytest.raises(ValueError, match=r"has no config\.json"):
        axon_nb.pretrained(AutoModelForCausalLM, tmp_path)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(
        ValueError, match=r"no model\.safetensors.*pytorch_model\.bin.*save_pretrained"
    ):
        axon_nb.pretrained(AutoModelForCausalLM, tmp_path)
    with pytest.raises(ValueError, match="snapshot_download"):
        axon_nb.pretrained(AutoModelForCausalLM, "meta-llama/Llama-3.2-1B")

    class OnlyFromPretrained:
        @classmethod
        def from_pretrained(cls, path: str) -> Any: ...

    with pytest.raises(ValueError, match="no from_config"):
        axon_nb.pretrained(OnlyFromPretrained, saved["plain"])
    with pytest.raises(ValueError, match="a transformers model class"):
        axon_nb.pretrained(42, saved["plain"])
    with pytest.raises(ValueError, match=r"not a \.safetensors file"):
        axon_nb.pretrained(_gpt, saved["plain"] / "config.json")
    with pytest.raises(ValueError, match="for transformers classes"):
        axon_nb.pretrained(_gpt, saved["plain"], dtype="bfloat16")
    # on the ranks, before anything is laid out: a head the checkpoint lacks
    head = axon_nb.pretrained(AutoModelForSequenceClassification, saved["plain"], num_labels=3)
    with pytest.raises(
        axon_nb.RankError,
        match=r"1 parameter\(s\) have no tensor in the files: score\.weight.*"
        r"from_pretrained\(path\), which initialises them randomly",
    ):
        pooled_cluster_2.train(model=head, strategy=FSDP(), **{**RUN, "steps": 1})
    wide = axon_nb.pretrained(AutoModelForCausalLM, saved["plain"], hidden_size=64)
    with pytest.raises(axon_nb.RankError, match=r"differ in shape.*\(64, 64\) in the model"):
        pooled_cluster_2.train(model=wide, **{**RUN, "steps": 1})
    unknown = axon_nb.pretrained(AutoModelForCausalLM, saved["plain"], no_such_option=1)
    with pytest.raises(axon_nb.RankError, match=r"\['no_such_option'\] are neither dtype"):
        pooled_cluster_2.train(model=unknown, **{**RUN, "steps": 1})
    assert pooled_cluster_2.run(lambda: 1) == [1, 1]


# -- memory: one copy per host, not one per rank ------------------------------------------

BIG = dict(
    vocab_size=4096, hidden_size=512, intermediate_size=2048, num_hidden_layers=10,
    num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64,
)  # fmt: skip
"""About 46M parameters, 184 MB in float32."""
ONE_COPY = 1.3
"""The bound on the peak resident memory the ranks add together while FSDP starts, in
checkpoints: each rank's shards (0.5 on 2 ranks) plus the largest tensor in flight."""


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(f"{field}:"))
    return int(line.split()[1]) / 1024


def _reset_peak() -> float:
    """(On a rank) release what earlier runs freed, reset the peak; the resident MiB now."""
    import ctypes
    import gc

    import transformers.models.llama.modeling_llama  # noqa: F401  (imports are not the model)

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from the current resident size
    return _status_mib("VmRSS")


def _peak() -> float:
    return _status_mib("VmHWM")


def _drop(name: str) -> None:
    from axon_nb.rank.training import trainstate

    trainstate.drop(name)


def startup_peak(cluster: axon_nb.Cluster, model: Any, name: str) -> float:
    """Resident MiB the ranks add together, at their peak, while an FSDP run starts."""
    before = cluster.run(_reset_peak, stream=False)
    cluster.train(model=model, strategy=FSDP(), name=name, **{**RUN, "steps": 0})
    peaks = cluster.run(_peak, stream=False)
    cluster.run(_drop, name, stream=False)
    return sum(p - b for p, b in zip(peaks, before, strict=True))


def test_a_host_holds_about_one_copy_while_fsdp_starts(
    pooled_cluster_2: axon_nb.Cluster, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(**BIG)).save_pretrained(tmp_path)
    size = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors")) / 2**20
    # (the whole model first: the modules a run imports on first use are then loaded too)
    whole = startup_peak(pooled_cluster_2, _from_pretrained(tmp_path), "whole")
    meta = startup_peak(
        pooled_cluster_2, axon_nb.pretrained(AutoModelForCausalLM, tmp_path), "meta"
    )
    print(f"checkpoint {size:.0f} MiB; peak added over 2 ranks: pretrained() {meta:.0f} MiB "
          f"({meta / size:.2f}x), from_pretrained on every rank {whole:.0f} MiB "
          f"({whole / size:.2f}x)")  # fmt: skip
    assert meta < ONE_COPY * size
    assert whole > 1.8 * size  # what it replaces: a whole model on every rank
