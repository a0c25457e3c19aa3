"""Rank side: how a model is laid out over the ranks.

``dims.py`` (``ParallelDims``) and ``config.py`` (``ParallelConfig``) are pure Python, so the
kernel checks layouts with them too; every other module imports torch and runs on the ranks:
``parallelize.py`` composes one technique per module (``apply_tp``, activation checkpointing,
the pipeline split, ``apply_fsdp`` / ``apply_ddp`` / ZeRO-1 / ZeRO-2), and ``grads.py``,
``grad_scaler.py`` and ``optim_state.py`` serve every layout.
"""
