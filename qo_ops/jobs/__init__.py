"""One module per operational job; each declares a ``SPEC`` listed in ``qo_ops.jobs.catalog``."""
