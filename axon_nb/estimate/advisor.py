"""``axon_nb.advise``: candidate strategies ranked by predicted step time, each with its
predicted memory per rank, whether it fits the device, and the reason in the terms of the
strategy guide (replicate while it fits; shard optimizer state, then gradients, then
parameters as memory runs short; split layers within a host over fast links; cut the model
into stages across slow ones).

Example::

    advice = axon_nb.advise(make_gpt, world_size=8, device_memory="80GB", hosts=1)
    advice            # a table in the notebook; print(advice) as text
    advice.best       # the strategy object ranked first
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

from axon_nb.estimate.memory_model import predict_memory
from axon_nb.estimate.optimizer_memory import state_bytes
from axon_nb.estimate.prediction import predict
from axon_nb.estimate.profile import ModelProfile
from axon_nb.estimate.rank_layout import rank_layouts
from axon_nb.estimate.step_time import Links, step_time
from axon_nb.tables import html_table, text_table

DEFAULT_LINKS = Links(intra_host=100e9, inter_host=10e9)
"""Bus bandwidth assumed when none is measured or given: a GPU host's links (NVLink-class,
100 GB/s) and a 100 Gb/s network between hosts. Measure yours with ``cluster.bandwidth()``."""
DEFAULT_DEVICE_FLOPS = 100e12
"""Sustained FLOP/s assumed per device when none is given (a current GPU in bf16 at a
typical utilization); only the ranking's absolute times depend on it."""
UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
         "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


@dataclass
class Advice:
    """Ranked candidates: ``rows`` of ``strategy`` (the object), ``name``, ``fits``,
    ``peak_bytes``, ``step_s``, ``samples_per_s``, ``comm_bytes`` and ``reason`` (or
    ``status``: why it cannot run)."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    device_memory: float = 0.0

    @property
    def best(self) -> Any:
        """The first candidate that fits, or None."""
        return next((r["strategy"] for r in self.rows if r.get("fits")), None)

    def __str__(self) -> str:
        return text_table(HEAD, [_cells(r) for r in self.rows], ragged_last=True)

    def _repr_html_(self) -> str:
        return html_table(HEAD, [_cells(r) for r in self.rows])


HEAD = ("#", "strategy", "fits", "memory/rank", "step", "samples/s", "comm/step", "why")


def _cells(r: dict[str, Any]) -> tuple[str, ...]:
    if "status" in r:
        return ("", r["name"], "no", "", "", "", "", r["status"])
    return (
        str(r["rank"]), r["name"], "yes" if r["fits"] else "no", _gib(r["peak_bytes"]),
        f"{r['step_s'] * 1e3:,.1f} ms", f"{r['samples_per_s']:,.0f}", _gib(r["comm_bytes"]),
        r["reason"],
    )  # fmt: skip


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**28 else f"{n / 2**20:,.1f} MiB"


def parse_memory(value: str | float) -> float:
    """Bytes from ``"80GB"`` (10^9), ``"80GiB"`` (2^30), ``"512MB"`` or a number of bytes."""
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return float(value)
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).upper() not in UNITS or float(match.group(1)) <= 0:
        raise ValueError(
            f"device_memory must be a size such as '80GB', '24GiB' or a number of bytes, "
            f"got {value!r}"
        )
    return float(match.group(1)) * UNITS[match.group(2).upper()]


def advise(
    model: Any = None,
    *,
    world_size: int,
    device_memory: str | float,
    hosts: int = 1,
    batch_size: int | None = None,
    data: Any = None,
    loss: Any = None,
    profile: ModelProfile | None = None,
    strategies: list[Any] | None = None,
    bandwidth: Any = None,
    device_flops: float | None = None,
    optimizer: Any = None,
    mixed_precision: str | None = None,
    device_type: str | None = None,
) -> Advice:
    """Rank ``strategies`` (by default a candidate of each kind that fits the world) for
    training ``model`` on ``world_size`` devices of ``device_memory`` over ``hosts`` hosts.

    The model is profiled in a subprocess (``axon_nb.estimate.profile``; on a cluster
    :meth:`Cluster.advise` profiles it on a rank) on ``data``'s first items, or on random
    tokens for a model with ``config.vocab_size`` and ``config.block_size`` (the reference
    GPT); pass ``profile=`` to reuse one. ``batch_size`` is the global batch (default 4 per
    rank). ``bandwidth``: a ``cluster.bandwidth()`` report, bytes/s, or
    ``{"intra_host": ..., "inter_host": ...}``; ``device_flops``: sustained FLOP/s per device.
    ``device_type`` (``"cuda"`` or ``"cpu"``) sets the optimizers' default paths, whose step
    temporaries differ: by default the profile's device (a rank's), or ``"cuda"`` when the
    model is profiled here.
    """
    memory = parse_memory(device_memory)
    optimizer = "adamw" if optimizer is None else optimizer  # train's default optimizer
    state_bytes(optimizer)  # an unknown optimizer is the caller's, not one candidate's, problem
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if not isinstance(hosts, int) or hosts < 1 or world_size % hosts:
        raise ValueError(
            f"hosts must be a positive integer that divides world_size={world_size}, got {hosts!r}"
        )
    if profile is None:
        if model is None:
            raise ValueError("advise needs a model (or profile=)")
        from axon_nb.estimate.probe_process import profile as probe

        profile = probe(model, data, loss)
        device_type = device_type or "cuda"  # (the subprocess's CPU is not the devices')
    if device_type is not None:
        profile = replace(profile, device_type=device_type)
    per_host = world_size // hosts
    batch = batch_size or 4 * world_size
    links = _links(bandwidth)
    flops = device_flops or DEFAULT_DEVICE_FLOPS
    candidates = strategies if strategies is not None else default_candidates(
        profile, world_size, per_host)  # fmt: skip
    rows = []
    for candidate in candidates:
        rows.append(_row(profile, candidate, world_size, per_host, batch, memory, links, flops,
                         optimizer, mixed_precision))  # fmt: skip
    runnable = sorted(
        (r for r in rows if "status" not in r),
        key=lambda r: (not r["fits"], r["step_s"] if r["fits"] else r["peak_bytes"]),
    )
    for i, r in enumerate(runnable, 1):
        r["rank"] = i
    return Advice([*runnable, *(r for r in rows if "status" in r)], memory)


def default_candidates(profile: ModelProfile, world_size: int, per_host: int) -> list[Any]:
    """One candidate of each kind that can run on ``world_size`` ranks."""
    from axon_nb.strategies import DDP, FSDP, Hybrid, Pipeline, TensorParallel, ZeRO

    found: list[Any] = [DDP(), ZeRO(stage=1), ZeRO(stage=2), FSDP(),
                        FSDP(activation_checkpointing=True)]  # fmt: skip
    if world_size > per_host:
        found.append(FSDP(sharding="hybrid_shard", shard_size=per_host))
    splittable = any(layer.tp_params for layer in profile.layers)
    for tp in (2, 4, 8):
        if splittable and tp <= per_host and world_size % tp == 0:
            found.append(
                TensorParallel() if tp == world_size else Hybrid(dp=world_size // tp, tp=tp)
            )
    experts = [layer.experts for layer in profile.layers if layer.experts]
    if experts:  # a mixture of experts: split them over as many ranks as divide them all
        from axon_nb.strategies import ExpertParallel

        fits = [ep for ep in (8, 4, 2) if world_size % ep == 0 and all(e % ep == 0 for e in
                experts)]  # fmt: skip
        if fits:
            found.append(ExpertParallel(ep=fits[0]))
    if len(profile.layers) >= 2 and world_size >= 2:
        pp = 2 if world_size > 2 else world_size
        found.append(Pipeline(microbatches=8) if pp == world_size
                     else Hybrid(dp=world_size // pp, pp=pp, microbatches=8))  # fmt: skip
    return found


def _row(profile: ModelProfile, candidate: Any, world: int, per_host: int, batch: int,
         memory: float, links: Links, flops: float, optimizer: Any,
         mixed: str | None) -> dict[str, Any]:  # fmt: skip
    from axon_nb.strategies import resolve_strategy

    name = getattr(candidate, "describe", lambda: repr(candidate))()
    try:
        strategy = resolve_strategy(candidate)
        name = strategy.describe()
        prediction = predict(profile, strategy, world_size=world, batch_size=batch,
                             ranks_per_host=per_host, optimizer=optimizer,
                             mixed_precision=mixed)  # fmt: skip
        layouts = rank_layouts(profile, strategy, world, batch, ranks_per_host=per_host)
    except ValueError as e:
        return {"strategy": candidate, "name": name, "status": f"cannot run: {e}".splitlines()[0]}
    step = max(
        step_time(profile, layout, links, device_flops=flops, ranks_per_host=per_host)["step_s"]
        for layout in layouts
    )
    peak = prediction.peak_bytes
    fits = peak <= memory
    reason = _reason(profile, layouts[0], prediction, optimizer)
    if not fits:
        reason = f"does not fit: {_gib(peak)} per rank > {_gib(memory)}; " + reason
    return {"strategy": strategy, "name": name, "fits": fits, "peak_bytes": peak,
            "step_s": step, "samples_per_s": batch / step if step else float("inf"),
            "comm_bytes": prediction.comm_bytes, "reason": reason}  # fmt: skip


def _reason(profile: ModelProfile, layout: Any, prediction: Any, optimizer: Any) -> str:
    """One line in the guide's terms: what the strategy splits, and what that costs."""
    dims, kind = layout.dims, layout.kind
    state = predict_memory(profile, layout, optimizer=optimizer)
    held = state["params"] + state["optimizer"]
    parts = []
    if kind == "ddp" or (kind == "none" and dims.tp == dims.pp == 1):
        parts.append(f"replicates the model ({_gib(held)} of parameters and optimizer state "
                     "per rank); one gradient all-reduce per step")  # fmt: skip
    elif kind == "zero1":
        parts.append(f"shards the optimizer state over {dims.dp} ranks; DDP's all-reduce plus "
                     "a broadcast of the updated parameters")  # fmt: skip
    elif kind == "zero2":
        parts.append(f"shards gradients and optimizer state over {dims.dp} ranks; DDP's "
                     "traffic, as a reduce-scatter and an all-gather")  # fmt: skip
    elif kind == "fsdp" and dims.dp_shard > 1:
        parts.append(f"shards parameters, gradients and optimizer state over {dims.dp_shard} "
                     "ranks; gathers parameters each step (1.5x DDP's traffic)")  # fmt: skip
    if layout.config.activation_checkpointing:
        parts.append("recomputes activations in backward (about 1/3 more compute)")
    if dims.tp > 1:
        parts.append(f"splits each layer over {dims.tp} ranks of a host; all-reduces "
                     "activations every layer")  # fmt: skip
    if dims.pp > 1:
        bubble = (dims.pp - 1) / (layout.microbatches + dims.pp - 1)
        parts.append(f"cuts the model into {dims.pp} stages; the pipeline idles "
                     f"{100 * bubble:.0f}% of a step")  # fmt: skip
    return "; ".join(parts) or "trains on one device"


def _links(bandwidth: Any) -> Links:
    if bandwidth is None:
        return DEFAULT_LINKS
    if isinstance(bandwidth, int | float):
        return Links(float(bandwidth), float(bandwidth))
    if isinstance(bandwidth, dict):
        try:
            return Links(float(bandwidth["intra_host"]), float(bandwidth["inter_host"]))
        except KeyError as e:
            raise ValueError(
                "bandwidth as a dict needs 'intra_host' and 'inter_host' (bytes/s)"
            ) from e
    if hasattr(bandwidth, "rows"):  # a BandwidthReport: all-reduce at its largest size
        return _measured_links(bandwidth)
    raise ValueError(
        "bandwidth must be a cluster.bandwidth() report, bytes/s, or "
        f"{{'intra_host': ..., 'inter_host': ...}}; got {type(bandwidth).__name__}"
    )


def _measured_links(report: Any) -> Links:
    def best(axis: str) -> float | None:
        rows = [r for r in report.rows if r["collective"] == "all_reduce" and r["axis"] == axis]
        return max(rows, key=lambda r: r["bytes"])["busbw"] if rows else None

    world = best("world")
    intra, inter = best("intra_host") or world, best("inter_host") or world
    if intra is None or inter is None:
        raise ValueError("the bandwidth report has no all_reduce rows: run "
                         "cluster.bandwidth('all_reduce') first")  # fmt: skip
    return Links(intra, inter)
