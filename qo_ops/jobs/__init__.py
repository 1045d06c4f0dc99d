"""One module per operational job. Each declares a ``SPEC`` listed in ``qo_ops.jobs.catalog``."""
