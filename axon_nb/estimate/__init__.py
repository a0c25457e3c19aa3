"""Predictions of what a strategy needs before it runs: per-rank memory and communication
from a measured :class:`ModelProfile` (``predict``), and the ZeRO paper's model-state
formulas (``memory``).

Example::

    profile = cluster.profile(model=make_gpt, data=ds, loss=lm_loss)
    axon_nb.estimate.predict(profile, FSDP(), world_size=8, batch_size=64).peak_bytes
    axon_nb.estimate.memory(1_000_000, ZeRO(stage=1), world_size=4)["total"]
"""

from axon_nb.estimate.advisor import Advice, advise
from axon_nb.estimate.prediction import Prediction, predict
from axon_nb.estimate.probe_process import profile
from axon_nb.estimate.profile import LayerProfile, ModelProfile
from axon_nb.estimate.zero_formulas import memory

__all__ = [
    "Advice",
    "LayerProfile",
    "ModelProfile",
    "Prediction",
    "advise",
    "memory",
    "predict",
    "profile",
]
