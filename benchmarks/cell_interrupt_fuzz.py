"""Ctrl-C as Jupyter sends it (SIGINT to the kernel's process group), at random moments of
`%%axon` cells of gloo all-reduces and of `cluster.train` calls, in a real kernel.

Each trial runs one call, interrupted once (or twice quickly) at a moment drawn over the whole
call and a little past it (its last 10% and "as the cell ends" included), then checks that
every rank is alive: a `%%axon` all-reduce cell and a 3-step `train` must work, and no
"Logging error" or "BrokenPipe" text may reach the notebook. Prints each trial and last
`survived/fired` (target 200/200).

    python benchmarks/cell_interrupt_fuzz.py --count 200
"""

from __future__ import annotations

import argparse
import random
import re
import threading
import time
from typing import Any

from axon_nb.notebooks import start_kernel

SETUP = """
%load_ext axon_nb
%axon_cluster 2 --timeout 60
import axon_nb, torch
from torch import nn
cluster = axon_nb.current_cluster()

def make_model():
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

data = torch.utils.data.TensorDataset(torch.randn(512, 8), torch.randn(512, 1))
loss = nn.functional.mse_loss
"""

CALLS = {
    "cell": "%%axon\nimport torch, torch.distributed as dist\nt = torch.ones(1024)\n"
    "for _ in range(N_REDUCES):\n    dist.all_reduce(t)",
    "train": "cluster.train(make_model, data, loss=loss, steps=TRAIN_STEPS, batch_size=16)",
}
CHECK = [
    "%%axon\nimport torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\n"
    "print('sum', t.item())",
    "print('steps', cluster.train(make_model, data, loss=loss, steps=3, batch_size=16).step)",
]
BAD = ("Logging error", "BrokenPipe")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def run(kc: Any, code: str, timeout: float = 120) -> tuple[str, str]:
    """Execute ``code``; (reply status, every stream and error text it produced)."""
    msg_id = kc.execute(code)
    text = []
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        content = msg["content"]
        if msg["msg_type"] == "stream":
            text.append(content["text"])
        elif msg["msg_type"] == "error":
            text.append("\n".join(content["traceback"]))
        elif msg["msg_type"] == "status" and content["execution_state"] == "idle":
            break
    while True:
        reply = kc.get_shell_msg(timeout=timeout)
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply["content"]["status"], "".join(text)


class Kernel:
    """A real IPython kernel with a 2-rank cluster and the calls calibrated to ~1.2 s."""

    def __init__(self) -> None:
        self.km, self.kc = start_kernel()
        status, text = run(self.kc, SETUP, timeout=180)
        if status != "ok":
            raise RuntimeError(f"set-up failed: {text}")
        self.calls = {
            "cell": CALLS["cell"].replace("N_REDUCES", str(self._calibrate("cell", 200))),
            "train": CALLS["train"].replace("TRAIN_STEPS", str(self._calibrate("train", 20))),
        }
        self.seconds = {name: self._time(code) for name, code in self.calls.items()}

    def _time(self, code: str) -> float:
        started = time.monotonic()
        status, text = run(self.kc, code)
        if status != "ok":
            raise RuntimeError(f"calibration failed: {text}")
        return time.monotonic() - started

    def _calibrate(self, name: str, count: int) -> int:
        key = "N_REDUCES" if name == "cell" else "TRAIN_STEPS"
        seconds = self._time(CALLS[name].replace(key, str(count)))
        return max(1, int(count * 1.2 / max(seconds, 1e-3)))

    def close(self) -> None:
        run(self.kc, "%axon_cluster --stop")
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)


def trial(kernel: Kernel, rng: random.Random) -> tuple[bool, str]:
    """One interrupted call and the checks after it: (usable, what happened)."""
    name = rng.choice(sorted(kernel.calls))
    length = kernel.seconds[name]
    delays = [rng.uniform(0.0, 1.1 * length)]
    if rng.random() < 0.3:  # a second, impatient Ctrl-C
        delays.append(delays[0] + rng.uniform(0.02, 0.3))
    timers = [threading.Timer(d, kernel.km.interrupt_kernel) for d in delays]
    for timer in timers:
        timer.start()
    status, text = run(kernel.kc, kernel.calls[name])
    for timer in timers:
        timer.join()
    time.sleep(0.2)  # a late interrupt lands between cells, as a user's would
    texts = [text]
    usable, failed = True, ""
    for check in CHECK:
        status_after, after = run(kernel.kc, check)
        if status_after != "ok" and "KeyboardInterrupt" in after:  # the late one landed here
            status_after, after = run(kernel.kc, check)
        texts.append(after)
        if status_after != "ok" and usable:
            failed = f"check {check.splitlines()[-1]!r} said:\n{after}"
        usable = usable and status_after == "ok"
    joined = "".join(texts)
    usable = usable and "sum 2.0" in joined and "steps 3" in joined
    bad = [b for b in BAD if b in joined]
    what = f"{name} at {[round(d / length, 2) for d in delays]} of the call: {status}"
    if bad or not usable:  # what the interrupted call said names the cause (a rank's log)
        said = f"the call said:\n{ANSI.sub('', text)[-2500:]}"
        what += f"; NOT USABLE {bad}; {said}\n{ANSI.sub('', failed)[-1500:]}"
        # the next trial starts fresh
        run(kernel.kc, "%axon_cluster --restart\ncluster = axon_nb.current_cluster()", timeout=180)
    return usable and not bad, what


def fire(count: int, *, seed: int = 0, log: bool = True) -> int:
    """Run ``count`` trials in one kernel; how many left every rank usable."""
    rng = random.Random(seed)
    kernel = Kernel()
    survived = 0
    try:
        for i in range(count):
            ok, what = trial(kernel, rng)
            survived += ok
            if log:
                print(f"{i + 1:3d} {what}", flush=True)
    finally:
        kernel.close()
    return survived


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    survived = fire(args.count, seed=args.seed)
    print(f"survived/fired: {survived}/{args.count}")


if __name__ == "__main__":
    main()
