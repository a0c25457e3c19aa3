"""The trainers users already run in cells train on the cluster's world: Hugging Face
``Trainer`` and an ``Accelerator()`` in ``%%axon`` cells, an Accelerate script under
``%axon_run``, Lightning Fabric (``strategy="ddp"``) joining the ranks' world without
launching processes. After each (``Trainer``'s and ``end_training``'s destroying the default
process group included) the next cell and ``cluster.train`` work. Run in a real kernel."""

from __future__ import annotations

import re
from typing import Any

import nbformat
import pytest

from axon_nb.notebooks import execute

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("lightning")

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(420)]

SCRIPT = """
import torch
from accelerate import Accelerator

acc = Accelerator(cpu=True)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = acc.prepare(model, opt)
loss = model(torch.ones(8, 4) * (acc.process_index + 1)).pow(2).mean()
acc.backward(loss)
opt.step()
print("script", acc.num_processes, float(next(model.parameters()).sum()))
acc.end_training()
"""

AFTER = """%%axon
import torch.distributed as dist
t = torch.ones(1)
dist.all_reduce(t)
print("sum", int(t), dist.get_world_size())
"""
"""The world still works: every rank in one all_reduce."""
SUM = r"sum (\d+) (\d+)"
EVERY_RANK_IN_ONE = {0: ("2", "2"), 1: ("2", "2")}

CELLS = {
    "start": "%load_ext axon_nb\n%axon_cluster 2",
    "trainer": """%%axon
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
torch.manual_seed(0)
model = LlamaForCausalLM(config)

class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 48
    def __getitem__(self, i):
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}

args = TrainingArguments(output_dir=OUT + "/trainer", per_device_train_batch_size=4,
                         max_steps=6, logging_steps=2, report_to=[], use_cpu=True,
                         save_strategy="no", seed=0)
trainer = Trainer(model=model, args=args, train_dataset=Rows())
done = trainer.train()
print("trainer world", trainer.args.world_size, "loss", round(done.training_loss, 6))
""",
    "after_trainer": AFTER,
    "accelerate": """%%axon
from accelerate import Accelerator
acc = Accelerator(cpu=True)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = acc.prepare(model, opt)
loss = model(torch.ones(8, 4) * (rank + 1)).pow(2).mean()
acc.backward(loss)
opt.step()
print("accelerate", acc.num_processes, acc.process_index == rank,
      round(float(next(model.parameters()).sum()), 6))
acc.end_training()
""",
    "after_accelerate": AFTER,
    "script": "%axon_run {script}",
    "fabric": """%%axon
import sys, psutil
from lightning.fabric import Fabric
argv, children = list(sys.argv), psutil.Process().children(recursive=True)
fabric = Fabric(accelerator="cpu", devices=world_size, strategy="ddp")
fabric.launch()
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = fabric.setup(model, opt)
loss = model(torch.ones(8, 4) * (rank + 1)).pow(2).mean()
fabric.backward(loss)
opt.step()
launched_none = sys.argv == argv and psutil.Process().children(recursive=True) == children
print("fabric", fabric.world_size, fabric.global_rank == rank, launched_none,
      round(float(next(model.parameters()).sum()), 6))
""",
    "after_fabric": AFTER,
    "train": """import axon_nb, torch
from torch import nn
def make():
    torch.manual_seed(0)
    return nn.Linear(4, 1)
data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
result = axon_nb.current_cluster().train(make, data, loss=nn.functional.mse_loss, steps=4,
                                         batch_size=8)
print("train steps", len(result.losses))
""",
    "stop": "%axon_cluster --stop",
}


@pytest.fixture(scope="module")
def cell_texts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("trainers")
    (tmp / "accelerate_script.py").write_text(SCRIPT)
    cells = [c.replace("{script}", str(tmp / "accelerate_script.py")) for c in CELLS.values()]
    cells[1] = f"%%axon\nOUT = {str(tmp)!r}\n" + cells[1].removeprefix("%%axon\n")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nbformat.write(nb, tmp / "trainers.ipynb")
    done = execute(tmp / "trainers.ipynb", tmp / "out.ipynb", timeout=300)
    return {name: _text(cell) for name, cell in zip(CELLS, done.cells, strict=True)}


def _text(cell: Any) -> str:
    parts = []
    for o in cell.get("outputs", []):
        parts.append(o.get("text") or "")
        parts.extend(str(v) for k, v in o.get("data", {}).items() if k.startswith("text/"))
    return "\n".join(parts)


def _per_rank(text: str, pattern: str) -> dict[int, tuple[str, ...]]:
    return {int(m[0]): m[1:] for m in re.findall(r"\[rank (\d)\] " + pattern, text)}


def test_hugging_face_trainer_trains_on_the_world_and_shows_its_progress(cell_texts) -> None:
    got = _per_rank(cell_texts["trainer"], r"trainer world (\d+) loss ([\d.]+)")
    assert got.keys() == {0, 1} and got[0] == got[1] and got[0][0] == "2"
    assert "6/6" in cell_texts["trainer"]  # its progress bar, shown from rank 0
    assert _per_rank(cell_texts["after_trainer"], SUM) == EVERY_RANK_IN_ONE


def test_accelerate_in_a_cell_and_as_a_script(cell_texts) -> None:
    got = _per_rank(cell_texts["accelerate"], r"accelerate (\d+) (\w+) ([-\d.]+)")
    assert got.keys() == {0, 1} and got[0] == got[1] and got[0][:2] == ("2", "True")
    assert _per_rank(cell_texts["after_accelerate"], SUM) == EVERY_RANK_IN_ONE
    script = _per_rank(cell_texts["script"], r"script (\d+) ([-\d.]+)")
    assert script.keys() == {0, 1} and script[0] == script[1] and script[0][0] == "2"


def test_lightning_fabric_joins_the_world_without_launching(cell_texts) -> None:
    got = _per_rank(cell_texts["fabric"], r"fabric (\d+) (\w+) (\w+) ([-\d.]+)")
    assert got.keys() == {0, 1} and got[0] == got[1] and got[0][:3] == ("2", "True", "True")
    assert _per_rank(cell_texts["after_fabric"], SUM) == EVERY_RANK_IN_ONE


def test_cluster_train_works_after_them(cell_texts) -> None:
    assert "train steps 4" in cell_texts["train"]
