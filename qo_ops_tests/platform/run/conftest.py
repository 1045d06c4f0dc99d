"""The quote_expiration world the runner's tests drive (``loaded``, from quote_runs.py).
test_faults.py, test_lease.py and test_liveness.py load their own (``loaded`` of
test_faults.py)."""

from qo_ops_tests.platform.run.quote_runs import loaded  # noqa: F401
