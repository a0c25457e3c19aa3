"""The Hugging Face example reads top to bottom in a real kernel (nbclient), two real ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import needs

from axon_nb.notebooks import execute

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300), needs("peft")]

EXAMPLES = Path(__file__).parent.parent / "examples"


def test_fine_tune_lora_notebook_executes(tmp_path: Path) -> None:
    nb = execute(EXAMPLES / "fine_tune_lora.ipynb", tmp_path / "fine_tune_lora.ipynb")
    text = "".join(out.get("text", "") for cell in nb.cells for out in cell.get("outputs", []))
    first, last = (float(x) for x in text.split("loss ")[1].split()[0:3:2])
    assert last < first * 0.9  # the adapter learned
    assert "'adapter_config.json', 'adapter_model.safetensors'" in text
    loaded = float(text.split("loaded adapter's loss on 4 rows: ")[1].split()[0])
    assert loaded < first * 0.95  # the loaded adapter is the trained one, not a fresh one
    assert "Stopped the cluster (2 ranks)." in text
