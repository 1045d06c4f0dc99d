"""Platform fixtures, shared by the tests of every group below (job/, run/, calls/,
schedule/, actions/, observability/): the Dagster tests' demo data and code location, for
the kill switch's schedule and sensor checks (actions/test_control.py); order_reconciliation's
demo world with its downstream simulator, for the review queue's decisions
(actions/test_recovery.py)."""

from qo_ops_tests.dagster.conftest import defs, instance, loaded  # noqa: F401
from qo_ops_tests.jobs.test_order_reconciliation import world  # noqa: F401
