"""The webserver for humans runs with ``--read-only`` (ops/dagster-ui/README.md): it answers
queries, but refuses launches, backfills and terminations, so runs are launched only through
the authenticated qo-ops API talking to the internal webserver.

What the installed Dagster returns (dagster_graphql/implementation/utils.py and
implementation/execution/__init__.py): ``launchRun`` and ``launchPartitionBackfill`` resolve
to ``UnauthorizedError`` "Authorization failed"; ``terminateRun`` of an existing run resolves
to ``TerminateRunFailure`` "You do not have permission to terminate this run" (of an unknown
run id: ``UnauthorizedError``). The HTTP status is 200 in every case.
"""

from __future__ import annotations

import uuid

import dagster as dg
import httpx
import pytest
from dagster_graphql import DagsterGraphQLClientError

from qo_ops_tests.dagster.stack import LOCATION, dagster_stack

REPOSITORY = {"repositoryLocationName": LOCATION, "repositoryName": "__repository__"}
TENANT = "tenant-001"
TAGS = {"dagster/partition": TENANT, "qo_ops/scope": f"quote_expiration:{TENANT}"}

READ = """
query($repo: RepositorySelector!) {
  repositoryOrError(repositorySelector: $repo) {
    __typename
    ... on Repository { jobs { name } }
  }
  runsOrError { __typename ... on Runs { results { runId } } }
  permissions { permission value disabledReason }
}"""

LAUNCH_RUN = """
mutation($params: ExecutionParams!) {
  launchRun(executionParams: $params) {
    __typename
    ... on Error { message }
    ... on LaunchRunSuccess { run { runId } }
  }
}"""

LAUNCH_BACKFILL = """
mutation($params: LaunchBackfillParams!) {
  launchPartitionBackfill(backfillParams: $params) {
    __typename
    ... on Error { message }
    ... on LaunchBackfillSuccess { backfillId }
  }
}"""

TERMINATE_RUN = """
mutation($runId: String!) {
  terminateRun(runId: $runId) {
    __typename
    ... on Error { message }
    ... on TerminateRunFailure { message run { runId status } }
    ... on TerminateRunSuccess { run { runId } }
  }
}"""

RUN_STATUS = """
query($runId: ID!) { runOrError(runId: $runId) { __typename ... on Run { status } } }"""


def _graphql(port: int, query: str, variables: dict) -> dict:
    response = httpx.post(
        f"http://127.0.0.1:{port}/graphql",
        json={"query": query, "variables": variables},
        timeout=60,
    )
    assert response.status_code == 200, response.text  # refusals are data, not HTTP errors
    body = response.json()
    assert "errors" not in body, body
    return body["data"]


def _launched(instance: dg.DagsterInstance) -> list[dg.DagsterRun]:
    """Runs not requested by the daemon's own sensors (stale_success_sensor requests
    recent_success_job runs, as it does on any deployment)."""
    return [r for r in instance.get_runs() if "dagster/sensor_name" not in r.tags]


def test_read_only_webserver_answers_queries_and_refuses_launch_and_terminate(loaded, tmp_path):
    with dagster_stack(loaded, tmp_path, read_only=True) as (client, instance, port):
        # reads work: the code location is loaded, the run list answers, permissions say why
        data = _graphql(port, READ, {"repo": REPOSITORY})
        assert data["repositoryOrError"]["__typename"] == "Repository"
        assert "quote_expiration" in {j["name"] for j in data["repositoryOrError"]["jobs"]}
        assert data["runsOrError"]["__typename"] == "Runs"
        listed = {r["runId"] for r in data["runsOrError"]["results"]}
        assert listed <= {r.run_id for r in instance.get_runs()} - {
            r.run_id for r in _launched(instance)
        }  # at most the daemon's own sensor runs
        permissions = {p["permission"]: p for p in data["permissions"]}
        for name in (
            "launch_pipeline_execution",
            "launch_partition_backfill",
            "terminate_pipeline_execution",
        ):
            assert permissions[name]["value"] is False
            assert permissions[name]["disabledReason"] == "Disabled by your administrator"

        # launchRun of quote_expiration for tenant-001, exactly as the qo-ops API would send it
        launched = _graphql(
            port,
            LAUNCH_RUN,
            {
                "params": {
                    "selector": {**REPOSITORY, "jobName": "quote_expiration"},
                    "runConfigData": {"ops": {"quote_expiration_op": {"config": {}}}},
                    "executionMetadata": {
                        "tags": [{"key": k, "value": v} for k, v in TAGS.items()]
                    },
                }
            },
        )["launchRun"]
        assert launched == {"__typename": "UnauthorizedError", "message": "Authorization failed"}

        # the Python client (what an API pointed at the wrong webserver would see) raises
        with pytest.raises(DagsterGraphQLClientError) as refused:
            client.submit_job_execution(
                "quote_expiration", repository_location_name=LOCATION, tags=TAGS
            )
        assert refused.value.args == ("UnauthorizedError", "Authorization failed")

        # a partition backfill is refused the same way
        backfill = _graphql(
            port,
            LAUNCH_BACKFILL,
            {
                "params": {
                    "selector": {
                        "partitionSetName": "quote_expiration_partition_set",
                        "repositorySelector": REPOSITORY,
                    },
                    "partitionNames": [TENANT],
                }
            },
        )["launchPartitionBackfill"]
        assert backfill == {"__typename": "UnauthorizedError", "message": "Authorization failed"}

        assert _launched(instance) == []
        assert instance.get_backfills() == []

        # terminateRun: a run in progress (created directly in the instance) cannot be stopped
        run_id = str(uuid.uuid4())
        instance.add_run(
            dg.DagsterRun(
                job_name="quote_expiration",
                run_id=run_id,
                status=dg.DagsterRunStatus.STARTED,
                tags=TAGS,
            )
        )
        terminated = _graphql(port, TERMINATE_RUN, {"runId": run_id})["terminateRun"]
        assert terminated == {
            "__typename": "TerminateRunFailure",
            "message": "You do not have permission to terminate this run",
            "run": {"runId": run_id, "status": "STARTED"},
        }
        assert _graphql(port, RUN_STATUS, {"runId": run_id})["runOrError"] == {
            "__typename": "Run",
            "status": "STARTED",
        }
        still = instance.get_run_by_id(run_id)
        assert still is not None and still.status == dg.DagsterRunStatus.STARTED
        assert [r.run_id for r in _launched(instance)] == [run_id]  # still nothing launched

        # an unknown run id is refused before it is looked up
        unknown = _graphql(port, TERMINATE_RUN, {"runId": str(uuid.uuid4())})["terminateRun"]
        assert unknown == {"__typename": "UnauthorizedError", "message": "Authorization failed"}
