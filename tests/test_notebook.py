"""The quickstart notebook runs in a real Jupyter kernel (nbclient) against a real cluster."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

from axon_nb.notebooks import execute

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

EXAMPLES = Path(__file__).parent.parent / "examples"


def test_quickstart_executes(tmp_path: Path) -> None:
    nb = execute(EXAMPLES / "quickstart.ipynb", tmp_path / "quickstart.ipynb")
    text = "".join(out.get("text", "") for cell in nb.cells for out in cell.get("outputs", []))
    assert "[rank 0] rank 0 of 2 on cpu" in text
    assert "[rank 1] [3.0, 3.0, 3.0]" in text
    assert "Stopped the cluster (2 ranks)" in text
    # A clean stop is one line: no engine log, no ipyparallel notice, nothing on stderr.
    [stop] = [c for c in nb.cells if c.cell_type == "code" and "--stop" in c.source]
    assert [(o["output_type"], o.get("name"), o.get("text")) for o in stop.outputs] == [
        ("stream", "stdout", "Stopped the cluster (2 ranks).\n")
    ]
    assert "Logging error" not in text and "BrokenPipe" not in text


def test_sharding_notebook_executes(tmp_path: Path) -> None:
    nb = execute(EXAMPLES / "sharding.ipynb", tmp_path / "sharding.ipynb")
    text = "".join(out.get("text", "") for cell in nb.cells for out in cell.get("outputs", []))
    assert "zero 2" in text and "fsdp shard_grad_op" in text
    assert "same losses after loading: True" in text


def test_dask_data_notebook_executes(tmp_path: Path) -> None:
    tables = set(Path(tempfile.gettempdir()).glob("axon-dask-*"))
    nb = execute(EXAMPLES / "dask_data.ipynb", tmp_path / "dask_data.ipynb")
    assert set(Path(tempfile.gettempdir()).glob("axon-dask-*")) <= tables  # it cleaned up
    outputs = [out for cell in nb.cells for out in cell.get("outputs", [])]
    text = "".join(out.get("text", "") for out in outputs)
    html = "".join(str(out.get("data", {}).get("text/html", "")) for out in outputs)
    assert "4 partitions" in text and 'dask dashboard: <a href="http://127.0.0.1:' in html
    first, last = (float(x) for x in text.split("loss ")[1].split()[0:3:2])
    assert last < first * 0.7  # it learned


def test_choose_strategy_notebook_executes(tmp_path: Path) -> None:
    nb = execute(EXAMPLES / "choose_strategy.ipynb", tmp_path / "choose_strategy.ipynb")
    text = "".join(out.get("text", "") for cell in nb.cells for out in cell.get("outputs", []))
    assert "busbw" in text  # the bandwidth table
    assert "best: " in text and "does not fit" in text  # 8 MB is too little for DDP
    assert text.count("memory predicted/measured") == 5


def test_fine_tune_eval_notebook_executes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("peft")
    pytest.importorskip("tensorboard")
    monkeypatch.chdir(tmp_path)  # the kernel's working dir: the events go to tmp_path/runs
    nb = execute(EXAMPLES / "fine_tune_eval.ipynb", tmp_path / "fine_tune_eval.ipynb")
    text = "".join(out.get("text", "") for cell in nb.cells for out in cell.get("outputs", []))
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
    assert list((tmp_path / "runs" / "fine_tune_eval").glob("events.out.tfevents.*"))
    assert "Stopped the cluster (2 ranks)." in text
