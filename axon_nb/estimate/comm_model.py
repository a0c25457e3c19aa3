"""Predicted communication of one rank per training step, by collective kind.

Bytes are what the communication meter counts (``axon_nb.metrics.comm``): the payload this
rank hands to each collective (an all-gather's input shard, a reduce-scatter's whole input,
both ends of a send/recv). With ``P`` the parameters of this rank's layers, ``T`` the
trainable ones (frozen parameters have no gradients to reduce and are never updated), ``b``
bytes per element, ``s`` the shards, ``A`` a layer's activation bytes for this rank's samples:

=============================  ==========================================================
DDP, ZeRO-1                    all-reduce ``T b`` (half with an fp16/bf16 comm hook)
ZeRO-1                         + broadcast ``T b`` (each rank's updated share to the rest)
ZeRO-2                         reduce-scatter ``T b``, all-gather ``T b / s``
FSDP / ZeRO-3                  all-gather ``P b / s`` in forward and again in backward
                               (once without resharding after forward; in a pipeline,
                               once per micro-batch and once more), reduce-scatter ``T b``;
                               hybrid sharding all-reduces the ``T b / s`` shards across
                               replicas
tensor parallel                all-reduce each row-parallel output (forward) and each
                               column-parallel input (backward)
sequence parallel              reduce-scatter both of those; all-gather their sequence
                               shards back (``A / tp``), and the stream entering and
                               leaving the blocks
expert parallel                all-to-all of 8 bytes per expert, then of each (token,
                               expert) assignment's hidden vector 4 times (there and
                               back, forward and backward); the experts' gradients
                               all-reduced over their ``edp`` replicas; DDP and FSDP
                               leave the experts out
pipeline                       send and receive each boundary activation and its gradient
                               (none behind frozen layers only), per micro-batch
LocalSGD (after warm-up)       all-reduce of ``T b`` every ``period`` steps, no gradients
AsyncSGD                       DDP's: all-reduce of ``T b`` every step (in the background)
DiLoCo                         all-reduce of ``T`` fp32 (bf16: 2 bytes) every
                               ``inner_steps`` steps; int8: all-gather of ``T`` bytes;
                               workers of FSDP ranks: FSDP's within a worker, and the
                               outer all-reduce of ``T / s`` across the workers
every step                     16 bytes: the loop's agreement on loss and stop
=============================  ==========================================================

Example::

    predict_comm(profile, layout)   # {"all_reduce": 939536.0}
"""

from __future__ import annotations

from collections import defaultdict

from axon_nb.estimate.profile import ModelProfile
from axon_nb.estimate.rank_layout import RankLayout
from axon_nb.spec.parallel_config import DiLoCoConfig

AGREEMENT_BYTES = 16
"""The training loop's per-step all-reduce (loss, stop flag; ``rank/training/agreement.py``)."""
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def predict_comm(
    profile: ModelProfile, layout: RankLayout, *, local_sgd_step: int | None = None
) -> dict[str, float]:
    """Bytes per collective kind in one steady step on this rank (``local_sgd_step``: which
    step, for LocalSGD's periodic averaging; by default the average over a period)."""
    kinds: dict[str, float] = defaultdict(float)
    for (_, kind), value in comm_by_axis(profile, layout, local_sgd_step=local_sgd_step).items():
        kinds[kind] += value
    return dict(kinds)


def comm_by_axis(
    profile: ModelProfile, layout: RankLayout, *, local_sgd_step: int | None = None
) -> dict[tuple[str, str], float]:
    """:func:`predict_comm` split by the mesh axis each collective runs over: ``(axis,
    kind) -> bytes``: ``dp`` (DDP, ZeRO-1/2), ``dp_shard`` (FSDP), ``dp_replicate`` (hybrid
    sharding's replicas), ``tp``,
    ``pp`` or ``world`` (the loop's agreement)."""
    out: dict[tuple[str, str], float] = defaultdict(float)
    out["world", "all_reduce"] += AGREEMENT_BYTES
    tp = layout.dims.tp
    layers = [profile.layers[i] for i in layout.layers]
    experts = layout.experts(layers)
    local = sum(layer.local_params(tp) for layer in layers) - experts
    trained = sum(layer.local_trainable(tp) for layer in layers) - experts
    b = profile.param_bytes
    _data_parallel(out, layout, (local, trained), b, local_sgd_step)
    if experts:
        _expert_parallel(out, layout, layers, experts * b)
    if tp > 1:
        _tensor_parallel(out, layout, layers)
    if layout.dims.pp > 1:
        _pipeline(out, profile, layout)
    return {key: value for key, value in out.items() if value}


def _diloco(
    out: dict[tuple[str, str], float],
    config: DiLoCoConfig,
    trained: float,
    step: int | None,
    axis: str = "dp",
) -> None:
    """DiLoCo's outer step every ``inner_steps`` steps (the first after step 0): an all-reduce
    of the outer gradients (fp32 or bf16), or with int8 an all-gather of them, over ``axis``
    (the workers: ``dp_replicate`` when each is a group of FSDP ranks, of its shards)."""
    h = config.inner_steps
    if step is not None and step % h != 0:
        return
    share = 1 / h if step is None else 1
    if config.compress == "int8":
        out[axis, "all_gather"] += (trained + 4) * share  # (each rank's int8 piece, its scale)
    else:
        out[axis, "all_reduce"] += trained * (2 if config.compress == "bf16" else 4) * share


def _data_parallel(
    out: dict[tuple[str, str], float],
    layout: RankLayout,
    params: tuple[float, float],
    b: int,
    step: int | None,
) -> None:
    """``params``: this rank's parameters, and the trainable ones among them."""
    (local, trained), kind, dp = params, layout.kind, layout.dims.dp
    if kind == "ddp" and layout.config.diloco is not None:
        _diloco(out, layout.config.diloco, trained, step)
    elif kind in ("ddp", "zero1"):
        sgd = layout.config.local_sgd
        ddp = layout.config.ddp
        hook = ddp.comm_hook if ddp is not None else None
        grad_b = 2 if hook in ("fp16", "bf16") else b
        if sgd is None or (step is not None and step < sgd.warmup_steps):
            out["dp", "all_reduce"] += trained * grad_b
        elif step is None or step % sgd.period == 0:
            out["dp", "all_reduce"] += trained * b / (sgd.period if step is None else 1)
        if kind == "zero1":
            out["dp", "broadcast"] += trained * b
    elif kind == "zero2":
        out["dp", "reduce_scatter"] += trained * b
        out["dp", "all_gather"] += trained * b / dp
    elif kind == "fsdp":
        fsdp = layout.config.fsdp
        assert fsdp is not None
        shards = layout.param_shards
        gather_b = DTYPE_BYTES.get(fsdp.param_dtype or "", b)
        reduce_b = DTYPE_BYTES.get(fsdp.reduce_dtype or fsdp.param_dtype or "", b)
        if shards > 1:
            if layout.dims.pp > 1:
                gathers = layout.microbatches + 1
            else:
                gathers = 2 if fsdp.reshard_after_forward else 1
            out["dp_shard", "all_gather"] += gathers * local * gather_b / shards
            out["dp_shard", "reduce_scatter"] += trained * reduce_b
        if layout.dims.dp_replicate > 1 and layout.config.diloco is not None:  # (workers)
            _diloco(out, layout.config.diloco, trained / shards, step, axis="dp_replicate")
        elif layout.dims.dp_replicate > 1:
            out["dp_replicate", "all_reduce"] += trained * reduce_b / shards


def _expert_parallel(
    out: dict[tuple[str, str], float], layout: RankLayout, layers: list, expert_bytes: float
) -> None:
    """Per MoE layer and micro-batch: the counts (8 bytes per expert), then each assignment's
    hidden vector there and back, in forward and again in backward (as many arrive as leave
    when the routing is balanced); the experts' gradients all-reduced over their replicas."""
    samples = layout.micro_samples * layout.microbatches
    routed = sum(layer.routed_bytes for layer in layers) * samples
    counts = sum(8 * layer.experts for layer in layers) * layout.microbatches
    out["ep", "all_to_all"] += 4 * routed + counts
    if layout.dims.edp > 1:
        out["edp", "all_reduce"] += expert_bytes / layout.dims.ep


def _tensor_parallel(out: dict[tuple[str, str], float], layout: RankLayout, layers: list) -> None:
    tp = layout.dims.tp
    samples = layout.micro_samples * layout.microbatches
    rowwise = sum(layer.rowwise_out_bytes for layer in layers) * samples
    if not (layout.config.tensor and layout.config.tensor.sequence_parallel):
        colwise = sum(layer.colwise_in_bytes for layer in layers) * samples
        out["tp", "all_reduce"] += rowwise + colwise
        return
    groups = sum(layer.colwise_group_bytes for layer in layers) * samples
    blocks = [layer for layer in layers if layer.block]
    boundary = 2 * blocks[0].output_bytes * samples if blocks else 0.0
    out["tp", "reduce_scatter"] += rowwise + groups
    out["tp", "all_gather"] += (rowwise + groups + boundary) / tp


def _pipeline(out: dict[tuple[str, str], float], profile: ModelProfile, layout: RankLayout) -> None:
    per_micro = layout.micro_samples * layout.microbatches
    for stage in layout.stages:
        if stage[0] > 0:  # receives its input, sends its gradient back
            ways = 2 if profile.carries_gradient(stage[0] - 1) else 1
            out["pp", "send_recv"] += ways * profile.layers[stage[0] - 1].output_bytes * per_micro
        if stage[-1] < len(profile.layers) - 1:  # sends its output, receives its gradient
            ways = 2 if profile.carries_gradient(stage[-1]) else 1
            out["pp", "send_recv"] += ways * profile.layers[stage[-1]].output_bytes * per_micro
