"""Where every byte of a peak goes: a zoo of models under every strategy, optimizer and dtype,
measured peak per rank beside the predicted one.

Trains each model of the zoo (MLPs of three sizes, a conv net, the reference GPT, a mixture of
experts, and models written by others: a transformers Llama and ViT and a PEFT LoRA adapter)
for 3 steps on 2 CPU ranks under DDP, ZeRO-1/2/3, FSDP (resharding after forward or not),
tensor and pipeline parallelism with AdamW, and under DDP, ZeRO-2 and FSDP with SGD
(momentum), Adam, AdamW's foreach and fused paths and bf16 autocast. For each it prints the
measured peak of the largest rank, the predicted one (``axon_nb.estimate.predict`` from a
probe of the model on a rank), their ratio, the phase each says holds the peak (forward,
backward, step, pipeline) and the bytes by part, measured (``peak_parts``: parameters,
gradients, buckets, optimizer state, step temporaries, activations, the backward working
set, gathered parameters) and predicted (the memory model's terms). The last lines: the
worst ratio and the share of cells within 10%, over the zoo and over the held-out models
(written by others; ``tests/test_memory_zoo.py`` checks them).

    python benchmarks/memory_zoo.py [--models mlp,gpt] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from collections.abc import Callable
from typing import Any

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # CPU ranks (gloo), also on a GPU host

import torch
from torch import nn

import axon_nb
from axon_nb import DDP, FSDP, Pipeline, TensorParallel, ZeRO
from axon_nb.models import GPT, GPTConfig, lm_loss, token_dataset

HELD_OUT = ("llama", "vit", "lora")
"""Models written by others, kept out of choosing the memory model's terms."""
STRATEGIES = {
    "DDP": DDP(), "ZeRO-1": ZeRO(stage=1), "ZeRO-2": ZeRO(stage=2), "ZeRO-3": ZeRO(stage=3),
    "FSDP": FSDP(), "FSDP no reshard": FSDP(reshard_after_forward=False),
    "TP": TensorParallel(), "PP": Pipeline(microbatches=4),
}  # fmt: skip
OPTIMIZERS = {
    "sgd": ("sgd", {"lr": 0.01, "momentum": 0.9}), "adam": ("adam", {"lr": 1e-3}),
    "adamw": ("adamw", {"lr": 1e-3}), "adamw foreach": ("adamw", {"lr": 1e-3, "foreach": True}),
    "adamw fused": ("adamw", {"lr": 1e-3, "fused": True}),
}  # fmt: skip
BATCH = 16


def mlp(sizes: tuple[int, ...]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise(sizes):
            layers += [nn.Linear(a, b), nn.GELU()]
        return nn.Sequential(*layers[:-1])

    return build


def vectors(width: int, classes: int) -> Callable[[], Any]:
    def data() -> Any:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(256, width, generator=g)
        return torch.utils.data.TensorDataset(x, torch.randint(0, classes, (256,), generator=g))

    return data


def convnet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(64, 10),
    )  # fmt: skip


def images() -> Any:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 3, 16, 16, generator=g)
    return torch.utils.data.TensorDataset(x, torch.randint(0, 10, (256,), generator=g))


GPT_CONFIG = GPTConfig(n_layer=4, n_embd=128, n_head=4, vocab_size=256, block_size=32)
MOE_CONFIG = GPTConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=256, block_size=32,
                       experts=4, top_k=2)  # fmt: skip


def gpt() -> nn.Module:
    return GPT(GPT_CONFIG)


def moe() -> nn.Module:
    return GPT(MOE_CONFIG)


def tokens() -> Any:
    return token_dataset(256, block_size=32, vocab_size=256)


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def lora() -> nn.Module:
    from peft import LoraConfig, get_peft_model

    adapter = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    return get_peft_model(llama(), adapter)


class TokenRows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Rows of 32 token ids, labelled with themselves (the model shifts them)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, 256, (256, 32), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=32, patch_size=4, num_channels=3, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=128, num_labels=10,
    )  # fmt: skip
    torch.manual_seed(0)
    return ViTForImageClassification(config)


class Pictures(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """32x32 images with labels, as an image processor gives them."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(256, 3, 32, 32, generator=g)
        self.y = torch.randint(0, 10, (256,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.x[i], "labels": self.y[i]}


CE = nn.functional.cross_entropy
ZOO: dict[str, dict[str, Any]] = {
    "mlp small": {"model": mlp((64, 128, 128, 10)), "data": vectors(64, 10), "loss": CE},
    "mlp": {"model": mlp((64, 512, 512, 512, 10)), "data": vectors(64, 10), "loss": CE},
    "mlp wide": {"model": mlp((256, 1024, 1024, 256)), "data": vectors(256, 256), "loss": CE},
    "convnet": {"model": convnet, "data": images, "loss": CE},
    "gpt": {"model": gpt, "data": tokens, "loss": lm_loss},
    "moe": {"model": moe, "data": tokens, "loss": None},
    "llama": {"model": llama, "data": TokenRows, "loss": None},
    "vit": {"model": vit, "data": Pictures, "loss": None},
    "lora": {"model": lora, "data": TokenRows, "loss": None},
}


def cells(quick: bool, dtype: str | None = None) -> list[tuple[str, str, str | None]]:
    """(strategy, optimizer, mixed precision) of each cell a model is trained in (only those
    of ``dtype``, fp32 or bf16, when given)."""
    every = [(name, "adamw", None) for name in STRATEGIES]
    varied = ["DDP", "ZeRO-2", "FSDP"]
    others = [(s, o, None) for s in varied for o in OPTIMIZERS if o != "adamw"]
    half = [(s, "adamw", "bf16") for s in varied]
    chosen = every if quick else every + others + half
    return [c for c in chosen if dtype is None or (c[2] or "fp32") == dtype]


def measure(
    cluster: axon_nb.Cluster, name: str, quick: bool, dtype: str | None = None
) -> list[dict[str, Any]]:
    """Every cell of model ``name``: measured and predicted peaks, phases and parts."""
    zoo = ZOO[name]
    profile = cluster.profile(zoo["model"], zoo["data"], zoo["loss"])
    rows = []
    for strategy_name, optimizer_name, mixed in cells(quick, dtype):
        strategy, optimizer = STRATEGIES[strategy_name], OPTIMIZERS[optimizer_name]
        row: dict[str, Any] = {"model": name, "strategy": strategy_name,
                               "optimizer": optimizer_name, "dtype": mixed or "fp32"}  # fmt: skip
        try:
            predicted = axon_nb.estimate.predict(
                profile, strategy, world_size=len(cluster.targets()), batch_size=BATCH,
                optimizer=optimizer, mixed_precision=mixed,
            )  # fmt: skip
            result = cluster.train(
                **zoo, strategy=strategy, optimizer=optimizer, mixed_precision=mixed,
                steps=3, batch_size=BATCH, metrics_interval_s=0,
            )  # fmt: skip
        except Exception as e:  # a cell that cannot run says why, and the zoo goes on
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
            rows.append(row)
            continue
        top = max(result.memory, key=lambda m: m["peak_bytes"])
        rank = max(predicted.ranks, key=lambda r: r["memory"]["peak"])["memory"]
        row.update(
            measured=top["peak_bytes"], predicted=predicted.peak_bytes,
            phase=top.get("peak_phase"), predicted_phase=getattr(predicted, "peak_phase", None),
            parts=top.get("peak_parts", {}),
            predicted_parts={k: v for k, v in rank.items()
                             if k not in ("peak", "phase", "offloaded") and v},
            # (a checkout from before the phases and parts prints None and {} for them)
        )  # fmt: skip
        rows.append(row)
        print(line(row), flush=True)
    return rows


def line(row: dict[str, Any]) -> str:
    def parts(p: dict[str, float]) -> str:
        return " ".join(f"{k}={v / 2**20:.2f}" for k, v in sorted(p.items()))

    head = f"{row['model']:10} {row['strategy']:15} {row['optimizer']:13} {row['dtype']:5}"
    if "error" in row:
        return f"{head} not run: {row['error']}"
    ratio = row["predicted"] / row["measured"]
    return (
        f"{head} measured {row['measured'] / 2**20:7.2f} MiB ({row['phase']}) predicted "
        f"{row['predicted'] / 2**20:7.2f} MiB ({row['predicted_phase']}) ratio {ratio:.3f}\n"
        f"{'':46} measured:  {parts(row['parts'])}\n"
        f"{'':46} predicted: {parts(row['predicted_parts'])}"
    )


def summary(rows: list[dict[str, Any]], label: str) -> str:
    ratios = [r["predicted"] / r["measured"] for r in rows if "measured" in r]
    if not ratios:
        return f"{label}: no cells ran"
    within = sum(0.9 <= r <= 1.1 for r in ratios)
    worst = max(ratios, key=lambda r: abs(r - 1))
    phases = sum(r["phase"] == r["predicted_phase"] for r in rows if "measured" in r)
    return (
        f"{label}: {within}/{len(ratios)} cells within 10% (ratios {min(ratios):.3f}-"
        f"{max(ratios):.3f}, worst {worst:.3f}); phase right in {phases}/{len(ratios)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(ZOO))
    parser.add_argument("--quick", action="store_true", help="AdamW fp32 cells only")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], help="only the cells of this dtype")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    names = args.models.split(",")
    unknown = [n for n in names if n not in ZOO]
    if unknown:
        sys.exit(f"unknown models {unknown}; the zoo has {', '.join(ZOO)}")
    rows: list[dict[str, Any]] = []
    with axon_nb.Cluster(n=2, timeout=180) as cluster:
        for name in names:
            rows += measure(cluster, name, args.quick, args.dtype)
    for row in rows:
        if "error" in row:
            print(line(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(summary([r for r in rows if r["model"] not in HELD_OUT], "zoo (terms chosen on)"))
    print(summary([r for r in rows if r["model"] in HELD_OUT], "held out (written by others)"))


if __name__ == "__main__":
    main()
