"""Code that runs on the ranks (ipyparallel engines). Never imports widgets."""
