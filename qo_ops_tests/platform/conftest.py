"""Platform fixtures: the Dagster tests' demo data and code location, for the kill switch's
schedule and sensor checks (test_control.py)."""

from qo_ops_tests.dagster.conftest import defs, instance, loaded  # noqa: F401
