"""Every function the kernel sends to the ranks, in one list.

The kernel calls these through ``Transport.send`` (``cluster.send(entry.train, ...)``); each
imports what it runs only when it runs, on the rank, so importing this module (as the kernel
does, to pickle references to these functions) imports no torch.

Nothing else on the rank side is called from the kernel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from axon_nb.spec.bootstrap_spec import BootstrapSpec
    from axon_nb.spec.checkpoint_format import SaveTarget
    from axon_nb.spec.placement import Probe, RankPlan
    from axon_nb.spec.train_spec import TrainSpec


# -- the one way in for work --------------------------------------------------------------


def call(packed: bytes) -> Any:
    """Run a call the kernel packed (``cluster/sending.py``): a function and its arguments,
    pickled with cloudpickle so that functions defined in a notebook bring their globals."""
    from axon_nb.rank.world.packed_call import run_packed

    return run_packed(packed)


# -- joining the world ----------------------------------------------------------------------


def bootstrap_mpi(spec: BootstrapSpec) -> dict[str, Any]:
    """Under MPI: find rank, host and device among the ranks and join the torch world."""
    from axon_nb.rank.world import bootstrap

    return bootstrap.bootstrap_mpi(spec)


def probe_by_engine_id(world_size: int) -> Probe:
    """Without MPI: this engine's facts, taking its engine id as its rank (all on one host)."""
    from IPython import get_ipython

    from axon_nb.rank.world import bootstrap

    rank = int(get_ipython().kernel.engine_id)  # ipyparallel engines expose their id here
    return bootstrap.probe(rank, rank, world_size)


def join_world(
    plan: RankPlan, timeout_s: float, watch_dir: str | None, store_name: str | None = None
) -> dict[str, Any]:
    """Without MPI: join the torch world as the kernel planned (``store_name``: a resize's
    rendezvous file, which the ranks that stay join too)."""
    from axon_nb.rank.world import bootstrap

    return bootstrap.join_world(plan, timeout_s, watch_dir=watch_dir, store_name=store_name)


# -- resizing the world (cluster/resize.py; rank/world/resize.py) ----------------------------


def probe_for_resize(spec: BootstrapSpec) -> Probe:
    """This engine's facts for a resize's plan, its engine id as its rank (the kernel fills in
    its place on its host)."""
    from IPython import get_ipython

    from axon_nb.rank.world import bootstrap

    rank = int(get_ipython().kernel.engine_id)
    return bootstrap.probe(rank, 0, 0, spec)


def leave_for_resize(keep: str | None) -> dict[str, Any]:
    """(Every old rank) pack the run ``keep``, drop the rest built on the old world, leave it."""
    from axon_nb.rank.world import resize

    return resize.leave_for_resize(keep)


def retire() -> int:
    """(A rank a resize removes) end this engine once it answered; its pid."""
    from axon_nb.rank.world import resize

    return resize.retire()


def rejoin(plan: RankPlan, store_name: str) -> dict[str, Any]:
    """(A rank a resize keeps) join the resized world with the same rank and device."""
    from axon_nb.rank.world import resize

    return resize.rejoin(plan, store_name)


def hold_moved(name: str) -> None:
    """(Every rank of the resized world) the run ``name`` is rebuilt by its next call."""
    from axon_nb.rank.training import moved_run

    moved_run.hold(name)


def free_port() -> int:
    """A free TCP port on this rank's host (for a new rendezvous)."""
    from axon_nb.rank.world.rendezvous_port import free_port as pick

    return pick()


def reform(master_port: int, store_name: str | None = None) -> dict[str, object]:
    """Leave the current process group and join a fresh one on ``master_port`` (its store
    file named ``store_name``)."""
    from axon_nb.rank.world import world

    return world.reform(master_port, store_name)


def collectives_issued() -> dict[str, int]:
    """Collectives issued so far on each of this rank's process groups, by group name."""
    from axon_nb.rank.world import world

    return world.collectives_issued()


def sever() -> int:
    """Make this rank's pending collectives fail (its peers have left them)."""
    from axon_nb.rank.world import world

    return world.sever()


def open_relay() -> str:
    """Open this rank's end of the host relay (``rank/world/relay.py``); its address."""
    from axon_nb.rank.world import relay

    return relay.open_relay()


def keep_runs(root: str, keeper_pid: int) -> int:
    """(A detached cluster's rank) keep output and runs under ``root``
    (``rank/world/kept_runs.py``) and end with the cluster's keeper; this rank's pid."""
    from axon_nb.rank import runtime
    from axon_nb.rank.world import kept_runs

    kept_runs.keep(root, runtime.context().rank)
    kept_runs.end_with(keeper_pid)
    return __import__("os").getpid()


def forward(header: dict[str, Any], payload: bytes,
            plan: dict[int, list[tuple[int, str, str, int]]]) -> int:  # fmt: skip
    """(A host's leader) pass relayed work on to the host's target ranks."""
    from axon_nb.rank.world import relay

    return relay.forward(header, payload, plan)


# -- work -----------------------------------------------------------------------------------


# Work that imports and builds things runs with Ctrl-C held back during imports (see
# rank/world/interrupts.py): an interrupt mid-import would break the module for good.


def expert_layout_problem(factory: Any, plan: Any, ep: int) -> str | None:
    """Why the model ``factory`` builds cannot be split over ``ep`` expert-parallel ranks with
    ``plan`` (checked on a meta-device copy), or None."""
    from axon_nb.parallel.expert_plan import factory_problem

    return factory_problem(factory, plan, ep)


def train(spec: TrainSpec, run_id: str) -> dict[str, Any]:
    """Run a training spec to the end; this rank's summary. A first Ctrl-C from here on
    (imports and setup included) stops the run at a step boundary; so does the cluster's
    preemption notice, after which every rank checkpoints (``rank/preemption.py``)."""
    import os

    from axon_nb.rank.preemption import Preemption
    from axon_nb.spec.notice_signal import ENV

    # the cluster's preemption notice (USR2 by default) stops it too, with a checkpoint
    with Preemption(os.environ.get(ENV, "USR2")) as notice:
        from axon_nb.rank.training import loop

        def preempted(state: Any) -> dict[str, Any] | None:
            if not notice.agree():  # (every rank: the run stopped on all of them)
                return None
            directory = spec.checkpoint_dir or os.path.join("axon_checkpoints", spec.name)
            return notice.checkpoint(spec.name, state.step, directory)

        return loop.train_on_rank(spec, run_id, notice.stop, preempted)


def save_checkpoint(name: str, target: SaveTarget) -> int:
    """Write run ``name``'s checkpoint where ``target`` says (every rank takes part); the step
    saved."""
    from axon_nb.rank.world.interrupts import import_safe_interrupts

    with import_safe_interrupts():
        from axon_nb.rank.checkpoint import checkpoint_io

        return checkpoint_io.save(name, target)


def load_checkpoint(name: str, path: str) -> int:
    """Load the checkpoint at ``path`` into run ``name``; the step loaded."""
    from axon_nb.rank.world.interrupts import import_safe_interrupts

    with import_safe_interrupts():
        from axon_nb.rank.checkpoint import checkpoint_io

        return checkpoint_io.load(name, path)


def rescue_pieces(name: str, directory: str) -> dict[str, Any]:
    """(Each survivor of a dead rank) write the pieces of run ``name`` this rank holds into
    ``directory``, with no collective."""
    from axon_nb.rank.checkpoint import rescue

    return rescue.write_pieces(name, directory)


def rescue_assemble(name: str, target: SaveTarget, dead: list[int]) -> dict[str, Any]:
    """(One survivor) put every survivor's pieces together into a full checkpoint."""
    from axon_nb.rank.checkpoint import rescue

    return rescue.assemble(name, target, dead)


def slurm_task(job_dir: str) -> int:
    """(Each task of a Slurm batch job, under submitit) run this task's rank of the job."""
    from axon_nb.rank.job_slurm_task import run_task

    return run_task(job_dir)


def run_script(path: str, args: list[str], cwd: str) -> int:
    """Run a torchrun-style script as a child process of this rank; its exit code."""
    from axon_nb.rank import script

    return script.run_script(path, args, cwd)


def rank_status() -> dict[str, Any]:
    """This rank's placement, memory and training runs (``%axon_status``)."""
    from axon_nb.rank.observe import rank_status

    return rank_status.rank_status()


# -- features: each imports its implementation on the rank ----------------------------------


def profile_model(model: Any, data: Any, loss: Any, samples: int) -> dict[str, Any]:
    """One probe forward and backward of ``model`` (``Cluster.profile``), and the type of
    this rank's device (the optimizer's default path depends on it)."""
    from axon_nb.rank.observe.model_probe import profile_from
    from axon_nb.rank.runtime import context

    return {**profile_from(model, data, loss, samples), "device_type": context().device.type}


def measure_collectives(*args: Any, **kwargs: Any) -> list[dict[str, Any]]:
    """Collective bandwidth on this rank's axis (``Cluster.bandwidth``)."""
    from axon_nb.rank.observe.collective_timing import measure

    return measure(*args, **kwargs)


def drop_run(name: str) -> None:
    """Forget a training run's state (``compare`` between candidates)."""
    import gc

    from axon_nb.rank.training import trainstate

    trainstate.drop(name)
    gc.collect()


def copy_run(source: str, spec: TrainSpec) -> int:
    """Lay out a copy of run ``source`` under the spec's strategy and name; its step
    (``compare(from_state=True)``)."""
    from axon_nb.rank import runtime
    from axon_nb.rank.training import relayout, trainstate

    return relayout.copy_run(spec, runtime.context(), trainstate.get(source)).step


def start_dask_worker(scheduler: str, pem: tuple[str, str, str]) -> None:
    """Start this rank's dask worker, named for the rank, with the cluster's authority,
    worker certificate and key as text (``Cluster.dask``)."""
    from axon_nb.rank import runtime
    from axon_nb.rank.data import dask_worker

    context = runtime.context()
    dask_worker.start_worker(scheduler, f"rank-{context.rank}", pem, context.private_dir)


def stop_dask_worker() -> None:
    """End this rank's dask worker, if it runs (a ``Cluster.dask`` that failed)."""
    from axon_nb.rank.data import dask_worker

    dask_worker.stop_worker()


def save_pretrained(name: str, partial: str) -> int:
    """Write run ``name``'s model with its own ``save_pretrained`` into ``partial`` (every
    rank takes part); the step saved."""
    from axon_nb.rank.world.interrupts import import_safe_interrupts

    with import_safe_interrupts():
        from axon_nb.rank.checkpoint import hf_export

        return hf_export.save_pretrained(name, partial)


# -- notebook datasets held once per host (rank/data/shared_tensors.py) ---------------------


def shared_write(pieces: list[tuple[str, int, int, Any]]) -> dict[str, str]:
    """(One rank per host) write pieces ``(key, nbytes, offset, chunk)`` of tensors' shared
    copies; the paths of the files created, by key."""
    from axon_nb.rank.data import shared_tensors

    return shared_tensors.write(pieces)


def shared_map(copies: dict[str, list[tuple[Any, str]]]) -> None:
    """Map each copy ``(SharedTensor, path)`` written on this rank's host (``copies`` by
    host) and hold it by key."""
    from axon_nb.rank.data import shared_tensors

    shared_tensors.map_files(copies)


def shared_unlink(keys: list[str]) -> None:
    """(The writing rank) remove the files of tensors ``keys``; the mappings live on."""
    from axon_nb.rank.data import shared_tensors

    shared_tensors.unlink(keys)


def shared_held(keys: list[str], drop: list[str]) -> list[str]:
    """Drop tensors ``drop``; which of ``keys`` this rank holds."""
    from axon_nb.rank.data import shared_tensors

    return shared_tensors.held(keys, drop)


def evaluate(
    name: str, data: Any, loss: Any, metrics: dict[str, Any], batch_size: int
) -> dict[str, float]:
    """Loss and metrics of run ``name``'s model over ``data`` (``Cluster.evaluate``)."""
    from axon_nb.rank.world.interrupts import import_safe_interrupts

    with import_safe_interrupts():
        from axon_nb.rank.training.evaluation import evaluate_run

    return evaluate_run(name, data, loss=loss, metrics=metrics, batch_size=batch_size)


def predict(name: str, data: Any, batch_size: int, output_dir: str | None) -> Any:
    """Outputs of run ``name``'s model for every item of ``data`` (``Cluster.predict``)."""
    from axon_nb.rank.world.interrupts import import_safe_interrupts

    with import_safe_interrupts():
        from axon_nb.rank.training.prediction import predict_run

    return predict_run(name, data, batch_size=batch_size, output_dir=output_dir)


def generate(
    name: str, input_ids: Any, attention_mask: Any, seed: int, max_new_tokens: int,
    options: dict[str, Any],
) -> Any:  # fmt: skip
    """Run ``name``'s causal LM's ``generate`` on every rank (``Cluster.generate``)."""
    from axon_nb.rank.world.interrupts import import_safe_interrupts

    with import_safe_interrupts():
        from axon_nb.rank.training.generation import generate_run

    return generate_run(
        name, input_ids, attention_mask=attention_mask, seed=seed,
        max_new_tokens=max_new_tokens, options=options,
    )  # fmt: skip
