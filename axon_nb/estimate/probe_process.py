"""Profile a model without a cluster: the probe (``axon_nb.rank.observe.model_probe``) runs in a
short-lived Python subprocess, so the kernel itself never imports torch.

Example::

    profile = axon_nb.estimate.profile(make_gpt, data=ds, loss=lm_loss)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

import cloudpickle

from axon_nb.estimate.profile import ModelProfile


def profile(
    model: Any, data: Any = None, loss: Any = None, *, samples: int = 4, timeout: float = 300
) -> ModelProfile:
    """Measure ``model`` (a module or a callable building one) on the first ``samples`` items
    of ``data`` (None: random tokens, for models with ``config.vocab_size`` and
    ``config.block_size``), with ``loss`` as ``train`` takes it, in a subprocess on the CPU.

    On a cluster, :meth:`Cluster.profile` measures on a rank instead.
    """
    with tempfile.TemporaryDirectory(prefix="axon_probe_") as tmp:
        request, answer = os.path.join(tmp, "in.pkl"), os.path.join(tmp, "out.json")
        with open(request, "wb") as f:
            cloudpickle.dump({"model": model, "data": data, "loss": loss, "samples": samples}, f)
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
        done = subprocess.run(
            [sys.executable, "-m", "axon_nb.rank.observe.model_probe", request, answer],
            capture_output=True, text=True, timeout=timeout, env=env, cwd=os.getcwd(),
        )  # fmt: skip
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        if done.returncode == 2 and last.startswith(("TypeError: ", "ValueError: ")):
            kind, _, message = last.partition(": ")
            raise (TypeError if kind == "TypeError" else ValueError)(message)
        if done.returncode != 0:
            raise RuntimeError(f"profiling the model failed in its subprocess: {last}")
        with open(answer) as f:
            return ModelProfile.from_dict(json.load(f))
