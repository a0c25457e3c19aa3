"""What ranks display shows live in the notebook, each rank in its own region: display
updates, ``clear_output``, ``\\r`` progress lines, tqdm's bars (text and widgets), and
``%%axon --ranks``. Run in a real kernel by nbclient; the saved notebook's outputs and the
times its messages arrived are asserted."""

from __future__ import annotations

import json
import time
from typing import Any

import nbformat
import pytest
from nbclient import NotebookClient
from traitlets.config import Config

from axon_nb.notebooks import ipc_kernel_options

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

WIDGET = "application/vnd.jupyter.widget-view+json"
CELLS = {
    "start": "%load_ext axon_nb\n%axon_cluster 2",
    # both ranks use the same display id: each must update its own display only
    "update": """%%axon
from IPython.display import clear_output, display, update_display
import sys, time
display(f"start {rank}", display_id="bar")
for i in range(3):
    time.sleep(0.5)
    update_display(f"rank {rank} step {i}", display_id="bar")
""",
    "clear": """%%axon
print("kept line")
for i in range(3):
    clear_output(wait=True)
    print(f"tick {i}")
    display(f"shown {i}")
    time.sleep(0.2)
""",
    "carriage": """%%axon
for i in range(5):
    sys.stderr.write(f"\\rprogress {i}/4"); sys.stderr.flush(); time.sleep(0.3)
sys.stderr.write("\\n")
print("after")
""",
    "tqdm_text": """%%axon
from tqdm import tqdm
for _ in tqdm(range(4), desc="text", mininterval=0):
    time.sleep(0.2)
""",
    "tqdm_widget": """%%axon
from tqdm.notebook import tqdm as notebook_tqdm
for _ in notebook_tqdm(range(4), desc="widget"):
    time.sleep(0.2)
""",
    "one_rank": "%%axon --ranks 0\ndisplay(f'only {rank}')",
    "stop": "%axon_cluster --stop",
}


class TimedClient(NotebookClient):
    """nbclient, noting when each message of each cell arrived."""

    arrivals: list[tuple[float, int, str, dict[str, Any]]]

    def process_message(self, msg: dict[str, Any], cell: Any, cell_index: int) -> Any:
        self.arrivals.append((time.monotonic(), cell_index, msg["msg_type"], msg["content"]))
        return super().process_message(msg, cell, cell_index)


@pytest.fixture(scope="module")
def executed_notebook(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[dict[str, Any], TimedClient]:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS.values()])
    client = TimedClient(
        nb,
        timeout=120,
        kernel_name="python3",
        store_widget_state=True,
        config=Config(KernelManager=ipc_kernel_options()),
    )
    client.arrivals = []
    client.execute()
    nbformat.write(nb, tmp_path_factory.mktemp("displays") / "displays.ipynb")
    cells = dict(zip(CELLS, nb.cells, strict=True))
    return cells, client


def texts(cell: Any) -> list[str]:
    """Each output's text: a stream's text, a display's text/plain."""
    return [o.get("text") or o.get("data", {}).get("text/plain", "") for o in cell.outputs]


def displays(cell: Any) -> list[str]:
    return [o.data.get("text/plain", "") for o in cell.outputs if o.output_type == "display_data"]


def test_each_rank_updates_its_own_display_while_the_cell_runs(executed_notebook) -> None:
    cells, client = executed_notebook
    want = ["[rank 0] 'rank 0 step 2'", "[rank 1] 'rank 1 step 2'"]
    assert sorted(displays(cells["update"])) == want
    index = list(CELLS).index("update")
    mine = [(t, kind) for t, i, kind, _ in client.arrivals if i == index]
    shown = min(t for t, kind in mine if kind == "display_data")
    ended = max(t for t, kind in mine if kind == "status")
    assert ended - shown > 1.0, "the display came only at the end of the cell"
    updates = [t for t, kind in mine if kind == "update_display_data"]
    assert len(updates) >= 4 and updates[0] < ended - 0.5


def test_clear_output_clears_only_its_ranks_region(executed_notebook) -> None:
    cells, _ = executed_notebook
    text = texts(cells["clear"])
    assert "[rank 0] kept line\n" in text and "[rank 1] kept line\n" in text
    for rank in (0, 1):
        assert f"[rank {rank}] tick 2" in text and f"[rank {rank}] 'shown 2'" in text
    assert not [t for t in text if "tick 0" in t or "tick 1" in t or "shown 0" in t]


def test_carriage_return_progress_is_one_live_line_per_rank(executed_notebook) -> None:
    cells, client = executed_notebook
    text = texts(cells["carriage"])
    assert "[rank 0] progress 4/4" in text and "[rank 1] progress 4/4" in text
    assert "[rank 0] after\n" in text and "[rank 1] after\n" in text
    assert not [t for t in text if "progress 0" in t or "progress 3" in t]
    index = list(CELLS).index("carriage")
    shown = [c["data"] for _, i, _, c in client.arrivals if i == index and "data" in c]
    lines = [data["text/plain"] for data in shown]
    assert len({line for line in lines if line.startswith("[rank 0] progress")}) >= 3


def test_tqdm_bars_show_per_rank_text_and_widgets(executed_notebook) -> None:
    cells, _ = executed_notebook
    # its last state: in the rank's live line, or printed once where it ended before it
    # could show (the rank's output came in one piece)
    lines = [line for t in texts(cells["tqdm_text"]) for line in t.splitlines()]
    for rank in (0, 1):
        mine = [line for line in lines if line.startswith(f"[rank {rank}] text:")]
        assert len(mine) == 1 and " 100%" in mine[0] and "4/4" in mine[0], lines
    outputs = cells["tqdm_widget"].outputs
    views = [o for o in outputs if WIDGET in o.data]
    assert len(views) == 2
    labels = sorted(o.data["text/plain"] for o in outputs if o not in views)
    assert labels == ["[rank 0]", "[rank 1]"]


def test_widget_bars_from_ranks_reach_the_end(executed_notebook) -> None:
    cells, client = executed_notebook
    state = client.nb.metadata.widgets["application/vnd.jupyter.widget-state+json"]["state"]
    views = [o.data.get(WIDGET) for o in cells["tqdm_widget"].outputs if WIDGET in o.data]
    assert len(views) == 2
    for view in views:
        box = state[view["model_id"]]
        bar = [state[c.removeprefix("IPY_MODEL_")] for c in box["state"]["children"]]
        values = [m["state"].get("value") for m in bar if m["model_name"] == "FloatProgressModel"]
        assert values == [4.0], json.dumps(bar)[:400]


def test_ranks_option_shows_that_ranks_output_only(executed_notebook) -> None:
    cells, _ = executed_notebook
    assert displays(cells["one_rank"]) == ["[rank 0] 'only 0'"]
