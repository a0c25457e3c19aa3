"""Code that runs on the ranks (ipyparallel engines). Never imports widgets.

``entry.py`` lists every function the kernel sends here; the rest is what they run.
"""
