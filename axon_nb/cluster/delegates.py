"""``FeatureDelegates``: the methods of ``Cluster`` that hand a feature its cluster, each a
function in its own module (``cluster/features.py``); ``Cluster`` adds the lifecycle."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from axon_nb.cluster import attaching, features
from axon_nb.cluster.transport import ClusterLike
from axon_nb.estimate import on_cluster

if TYPE_CHECKING:
    from pathlib import Path

    from axon_nb.cluster.bandwidth import BandwidthReport
    from axon_nb.estimate.advisor import Advice
    from axon_nb.spec.checkpoint_format import Checkpoint
    from axon_nb.train import TrainHandle
    from axon_nb.train.kept_handle import KeptHandle


class FeatureDelegates(ClusterLike):
    """Feature methods of :class:`axon_nb.Cluster` (see there)."""

    bandwidth_results: BandwidthReport | None

    def profile(self, model: Any, data: Any, loss: Any = None, *, samples: int = 4) -> Any:
        """Measure ``model`` on rank 0 (one forward and backward of ``samples`` items of
        ``data``): the :class:`~axon_nb.estimate.ModelProfile` that ``predict`` and ``advise``
        work from. Example::

            profile = cluster.profile(model=make_gpt, data=ds, loss=lm_loss)
        """
        return on_cluster.profile(**_forward(locals()))

    def advise(
        self, model: Any, data: Any = None, loss: Any = None, *, device_memory: str | float,
        batch_size: int | None = None, strategies: list[Any] | None = None,
        bandwidth: Any = None, device_flops: float | None = None, optimizer: Any = None,
        mixed_precision: str | None = None,
    ) -> Advice:  # fmt: skip
        """:func:`axon_nb.advise` for this world and its hosts, the model profiled on rank 0
        and the links from :meth:`bandwidth` when it has run. Example::

            cluster.advise(make_gpt, ds, lm_loss, device_memory="80GB", batch_size=64)
        """
        args = _forward(locals())
        args["bandwidth"] = self.bandwidth_results if bandwidth is None else bandwidth
        return on_cluster.advise(**args)

    def bandwidth(
        self, collectives: Sequence[str] | str | None = None,
        sizes: str | Sequence[int] = "1K:16M", *, iters: int = 10, warmup: int = 3,
    ) -> BandwidthReport:  # fmt: skip
        """Collective bandwidth and latency on these ranks as nccl-tests measures them
        (:func:`axon_nb.cluster.bandwidth.bandwidth`). Example::

            cluster.bandwidth("all_reduce", sizes="1M:64M")   # a table and a plot
        """
        return features.bandwidth(**_forward(locals()))

    def evaluate(
        self, data: Any, *, loss: Callable[..., Any] | None = None,
        metrics: Mapping[str, Callable[..., Any]] | None = None, batch_size: int,
        name: str = "model",
    ) -> dict[str, float]:  # fmt: skip
        """Loss and metrics of the model the ranks hold over ``data``, every sample once, under
        its own strategy: :func:`axon_nb.train.evaluate.evaluate`. Example::

        cluster.evaluate(test_ds, loss=mse, metrics={"mae": mae}, batch_size=64)
        """
        return features.evaluate(**_forward(locals()))

    def predict(
        self, data: Any, *, batch_size: int, name: str = "model",
        output_dir: str | os.PathLike[str] | None = None,
    ) -> Any:  # fmt: skip
        """The held model's outputs for every item of ``data``, in data order, as CPU tensors:
        :func:`axon_nb.train.predict.predict`. Example::

        logits = cluster.predict(test_ds, batch_size=64)
        """
        return features.predict(**_forward(locals()))

    def generate(
        self, input_ids: Any, *, max_new_tokens: int, attention_mask: Any = None,
        seed: int | None = None, name: str = "model", **generate_kwargs: Any,
    ) -> Any:  # fmt: skip
        """Continue prompts with the held transformers causal LM (DDP, FSDP, tensor parallel):
        :func:`axon_nb.train.generate.generate`. Example::

        cluster.generate(ids, max_new_tokens=20, do_sample=True, top_k=50, seed=0)
        """
        return features.generate(**_forward(locals()))

    def save(
        self, path: str | os.PathLike[str], kind: str = "full", *, name: str = "model",
        overwrite: bool = False, private: bool = True, format: str = "torch",
    ) -> Checkpoint | Path:  # fmt: skip
        """Save a run (:func:`axon_nb.checkpoint.save`); ``format="hf"``: its model for
        ``from_pretrained``. Example::

        cluster.save("ckpt/step100", kind="sharded")
        cluster.save("out/llama", format="hf")
        """
        return features.save(**_forward(locals()))

    def load(self, path: str | os.PathLike[str], *, name: str = "model") -> Checkpoint:
        """Load a checkpoint into run ``name`` (:func:`axon_nb.checkpoint.load`). Example::

        cluster.load("ckpt/step100")
        """
        return features.load(**_forward(locals()))

    def rescue(
        self, path: str | os.PathLike[str], *, name: str = "model", private: bool = True
    ) -> Checkpoint:
        """Save what the surviving ranks hold after a rank died
        (``axon_nb.checkpoint.on_cluster.rescue``). Example::

            cluster.rescue("ckpt/rescued")
        """
        return features.rescue(**_forward(locals()))

    def resize(
        self, n: int | None = None, *, add_hosts: Any = None, keep: bool = True
    ) -> dict[str, Any]:
        """Add or remove ranks of the running cluster (:func:`axon_nb.cluster.resize.resize`):
        the ranks with the highest numbers leave, new ones start in a second launch, and a
        run in progress (``block=False``) goes on in the new world from its next step, its
        global batch kept; between runs the latest run moves (``keep=False``: dropped).
        ``add_hosts``: where new ranks go on a cluster across hosts (``"node3:2"``).
        Returns what changed. Example::

            handle = cluster.train(..., block=False)
            cluster.resize(4)          # 2 -> 4 ranks; the run goes on at its next step
        """
        return features.resize(**_forward(locals()))

    def handle(self, name: str = "model") -> TrainHandle | KeptHandle:
        """Run ``name``'s handle: this kernel's own run, or on a detached cluster the run
        any kernel started, read from the cluster's directory (``train/kept_handle.py``)."""
        return attaching.handle(self, name)


def _forward(arguments: dict[str, Any]) -> dict[str, Any]:
    """A delegate's own arguments (its ``locals()``), for the function it delegates to, with
    the cluster as ``cluster``."""
    arguments = {k: v for k, v in arguments.items() if k != "__class__"}
    return {"cluster": arguments.pop("self"), **arguments}
