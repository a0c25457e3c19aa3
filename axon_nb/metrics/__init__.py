"""Probes that run on the ranks (memory, communication) and the throttled metrics stream.

The stream's schema is documented in :mod:`axon_nb.metrics.stream`.
"""
