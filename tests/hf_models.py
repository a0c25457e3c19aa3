"""Tiny random-init Hugging Face models and data as their users write them (imported by the
ranks from tests/; nothing is downloaded)."""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 64


def tiny_llama(dropout: float = 0.0) -> Any:
    """A 2-layer ``LlamaForCausalLM`` (sdpa), the same weights for the same seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attention_dropout=dropout, attn_implementation="sdpa",
    )  # fmt: skip
    return LlamaForCausalLM(config)


def tiny_mixtral() -> Any:
    """A 2-layer ``MixtralForCausalLM``, 4 experts, 2 per token (and a ``base_model_ep_plan``)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.0,
        attn_implementation="sdpa",
    )  # fmt: skip
    return MixtralForCausalLM(config)


def tiny_qwen_moe(version: int = 2) -> Any:
    """A 2-layer Qwen2-MoE or Qwen3-MoE causal LM with 4 experts, 2 per token (Qwen2's with
    its shared expert beside them)."""
    import transformers

    name = f"Qwen{version}Moe"
    config = getattr(transformers, f"{name}Config")(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, num_experts=4, num_experts_per_tok=2,
        router_aux_loss_coef=0.0, attn_implementation="sdpa",
        **({"shared_expert_intermediate_size": 24} if version == 2 else {"head_dim": 8}),
    )  # fmt: skip
    return getattr(transformers, f"{name}ForCausalLM")(config)


def pretrained_llama() -> Any:
    """What ``from_pretrained`` gives: a model in eval mode."""
    return tiny_llama(dropout=0.1).eval()


def lora_llama() -> Any:
    """The tiny Llama with a LoRA adapter on its attention projections (base frozen)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return get_peft_model(tiny_llama(), config)


def token_rows(count: int = 96, seed: int = 0) -> list[dict[str, list[int]]]:
    """Variable-length token rows (4 to 16 tokens) as a tokenizer gives them: lists of ints,
    labels the input ids with a "prompt" of -100 at the start."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        n = int(torch.randint(4, 17, (1,), generator=g))
        ids = torch.randint(1, VOCAB, (n,), generator=g).tolist()
        prompt = int(torch.randint(0, 3, (1,), generator=g))
        rows.append(
            {"input_ids": ids, "attention_mask": [1] * n, "labels": [-100] * prompt + ids[prompt:]}
        )
    return rows


class TokenRows(torch.utils.data.Dataset):
    """:func:`token_rows` as a map-style dataset of dicts."""

    def __init__(self, count: int = 96) -> None:
        self.rows = token_rows(count)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return self.rows[i]


def pad(items: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """A padding collator (what ``DataCollatorWithPadding`` does, plus -100 labels)."""
    width = max(len(item["input_ids"]) for item in items)
    fill = {"input_ids": 0, "attention_mask": 0, "labels": -100}
    return {
        key: torch.tensor([item[key] + [value] * (width - len(item[key])) for item in items])
        for key, value in fill.items()
    }


def hf_rows(streaming: bool = False, torch_format: bool = False) -> Any:
    """:func:`token_rows` of equal length 12 as a ``datasets.Dataset`` (or its stream)."""
    import datasets

    rows = [
        {"input_ids": r, "attention_mask": [1] * 12, "labels": r}
        for r in (
            torch.randint(1, VOCAB, (128, 12), generator=torch.Generator().manual_seed(1))
        ).tolist()
    ]
    ds = datasets.Dataset.from_list(rows)
    if torch_format:
        ds.set_format("torch")
    return ds.to_iterable_dataset() if streaming else ds


def tiny_vit() -> Any:
    """A 2-layer ``ViTForImageClassification`` on 16x16 images, 5 classes."""
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=64, num_labels=5,
    )  # fmt: skip
    return ViTForImageClassification(config)


def tiny_convnext() -> Any:
    """A 2-stage ``ConvNextForImageClassification`` on 16x16 images, 5 classes."""
    from transformers import ConvNextConfig, ConvNextForImageClassification

    config = ConvNextConfig(
        num_channels=3,
        num_stages=2,
        hidden_sizes=[8, 16],
        depths=[1, 1],
        patch_size=2,
        num_labels=5,
    )
    return ConvNextForImageClassification(config)


class AugmentedImages(torch.utils.data.Dataset):
    """Images as an image pipeline gives them: each item a dict of ``pixel_values`` and
    ``labels``, randomly flipped and shifted in the DataLoader's workers. The randomness is
    drawn from the sample's index, so every sample is augmented the same way on any rank."""

    def __init__(self, count: int = 96) -> None:
        g = torch.Generator().manual_seed(2)
        self.images = torch.rand(count, 3, 16, 16, generator=g)
        self.labels = torch.randint(0, 5, (count,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        info = torch.utils.data.get_worker_info()
        if info is None:
            raise RuntimeError("augmentation runs in the DataLoader's workers here")
        g = torch.Generator().manual_seed(1000 + i)
        image = self.images[i]
        if torch.rand(1, generator=g) < 0.5:
            image = image.flip(-1)
        shift = int(torch.randint(-2, 3, (1,), generator=g))
        image = image.roll(shift, dims=-2)
        return {"pixel_values": (image - 0.5) / 0.5, "labels": self.labels[i]}


class FixedTokens(torch.utils.data.Dataset):
    """Token rows of one length (no padding) as dicts of ``input_ids`` and ``labels``: every
    micro-batch has as many target tokens, so a pipeline's micro-batch means average to the
    batch's token mean."""

    def __init__(self, count: int = 96, length: int = 12) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(1, VOCAB, (count, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Pictures(torch.utils.data.Dataset):
    """16x16 images and labels as dicts of ``pixel_values`` and ``labels`` (no augmentation)."""

    def __init__(self, count: int = 96) -> None:
        g = torch.Generator().manual_seed(3)
        self.images = torch.randn(count, 3, 16, 16, generator=g)
        self.labels = torch.randint(0, 5, (count,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.images[i], "labels": self.labels[i]}
