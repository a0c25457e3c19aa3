"""One parallelism technique per module, each an ``apply_*`` function over a model and a mesh."""
