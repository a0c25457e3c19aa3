"""Binder runs every example: the environment ``binder/`` builds (``tests/binder_env.py``: a
clean checkout, ``requirements.txt``, then ``postBuild``) executes each notebook in
``examples/`` in its own kernel against real clusters, under mybinder's 2 GiB, and each
notebook shows what it promises."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

import pytest
from binder_env import LIMIT_BYTES, BinderEnv

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]

EXAMPLES = sorted(p.name for p in (Path(__file__).parent.parent / "examples").glob("*.ipynb"))


@pytest.fixture(scope="module")
def binder(tmp_path_factory: pytest.TempPathFactory) -> BinderEnv:
    return BinderEnv.build(tmp_path_factory.mktemp("binder"))


def run(binder: BinderEnv, name: str, tmp_path: Path) -> tuple[Any, str]:
    """The executed notebook, and its streams' text."""
    nb, peak = binder.execute(f"examples/{name}", tmp_path / name)
    print(f"{name}: peak {peak / 2**30:.2f} GiB")  # (pytest -s shows each)
    assert peak <= LIMIT_BYTES, f"{name} peaked at {peak / 2**30:.2f} GiB"
    text = "".join(out.get("text", "") for cell in nb.cells for out in cell.get("outputs", []))
    return nb, text


def test_every_example_is_tested() -> None:
    assert EXAMPLES == [
        "choose_strategy.ipynb", "dashboard.ipynb", "dask_data.ipynb", "fine_tune_eval.ipynb",
        "fine_tune_lora.ipynb", "quickstart.ipynb", "sharding.ipynb",
    ]  # fmt: skip


def test_quickstart(binder: BinderEnv, tmp_path: Path) -> None:
    nb, text = run(binder, "quickstart.ipynb", tmp_path)
    assert "[rank 0] rank 0 of 2 on cpu" in text
    assert "[rank 1] [3.0, 3.0, 3.0]" in text
    assert "Stopped the cluster (2 ranks)" in text
    assert "Logging error" not in text and "BrokenPipe" not in text
    # A clean stop is one line: no engine log, no ipyparallel notice, nothing on stderr.
    [stop] = [c for c in nb.cells if c.cell_type == "code" and "--stop" in c.source]
    assert [(o["output_type"], o.get("name"), o.get("text")) for o in stop.outputs] == [
        ("stream", "stdout", "Stopped the cluster (2 ranks).\n")
    ]


def test_sharding(binder: BinderEnv, tmp_path: Path) -> None:
    _, text = run(binder, "sharding.ipynb", tmp_path)
    assert "zero 2" in text and "fsdp shard_grad_op" in text
    assert "same losses after loading: True" in text


def test_dask_data(binder: BinderEnv, tmp_path: Path) -> None:
    tables = set(Path(tempfile.gettempdir()).glob("axon-dask-*"))
    nb, _ = run(binder, "dask_data.ipynb", tmp_path)
    assert set(Path(tempfile.gettempdir()).glob("axon-dask-*")) <= tables  # it cleaned up
    outputs = [out for cell in nb.cells for out in cell.get("outputs", [])]
    text = "".join(out.get("text", "") for out in outputs)
    html = "".join(str(out.get("data", {}).get("text/html", "")) for out in outputs)
    assert "4 partitions" in text and 'dask dashboard: <a href="http://127.0.0.1:' in html
    first, last = (float(x) for x in text.split("loss ")[1].split()[0:3:2])
    assert last < first * 0.7  # it learned


def test_choose_strategy(binder: BinderEnv, tmp_path: Path) -> None:
    _, text = run(binder, "choose_strategy.ipynb", tmp_path)
    assert "busbw" in text  # the bandwidth table
    assert "best: " in text and "does not fit" in text  # 8 MB is too little for DDP
    assert text.count("memory predicted/measured") == 5


def test_dashboard(binder: BinderEnv, tmp_path: Path) -> None:
    nb, _ = run(binder, "dashboard.ipynb", tmp_path)
    shown = [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "display_data"]
    assert any("application/vnd.jupyter.widget-view+json" in o.data for o in shown)
    text = "".join(str(o.get("data", {}).get("text/plain", "")) for c in nb.cells
                   for o in c.get("outputs", []))  # fmt: skip
    finished = r"<TrainResult 'model' finished at step 3000 \(3000 steps, 2 ranks"
    assert re.search(finished, text), text


def test_fine_tune_lora(binder: BinderEnv, tmp_path: Path) -> None:
    _, text = run(binder, "fine_tune_lora.ipynb", tmp_path)
    first, last = (float(x) for x in text.split("loss ")[1].split()[0:3:2])
    assert last < first * 0.9  # the adapter learned
    assert "'adapter_config.json', 'adapter_model.safetensors'" in text
    loaded = float(text.split("loaded adapter's loss on 4 rows: ")[1].split()[0])
    assert loaded < first * 0.95  # the loaded adapter is the trained one, not a fresh one
    assert "Stopped the cluster (2 ranks)." in text


def test_fine_tune_eval(binder: BinderEnv, tmp_path: Path) -> None:
    _, text = run(binder, "fine_tune_eval.ipynb", tmp_path)
    evals = [float(x) for x in re.findall(r"eval loss (\S+)", text)]
    assert len(evals) == 8  # steps 5, 10, ..., 40
    assert evals == sorted(evals, reverse=True) and evals[-1] < evals[0] / 10
    before = re.findall(r"^before: (\S+)$", text, re.MULTILINE)
    after = re.findall(r"^after: +(\S+) ", text, re.MULTILINE)
    assert len(before) == 3 and before != after
    assert after == ["abcdefghijkl", "klmnopqrstuv", "wxyzabcdefgh"]  # the pattern, learned
    assert "every continuation follows the alphabet: True" in text
    for tag, points in [("train/loss", 40), ("eval/loss", 8), ("eval/accuracy", 8)]:
        assert re.search(rf"{tag} +{points} points: step +\d+ \S+ -> step 40 ", text), tag
    assert list((binder.root / "runs" / "fine_tune_eval").glob("events.out.tfevents.*"))
    assert "Stopped the cluster (2 ranks)." in text
