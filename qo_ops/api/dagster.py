"""Launch, terminate and look up Dagster runs through the webserver's GraphQL API
(``QO_OPS_DAGSTER_URL``). Errors come back as :class:`DagsterUnavailable` with a safe
one-line message; nothing here raises a traceback at a caller's user."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from qo_ops.errors import one_line

REPOSITORY = "__repository__"

_LAUNCH = """
mutation QoOpsLaunch($executionParams: ExecutionParams!) {
  launchRun(executionParams: $executionParams) {
    __typename
    ... on LaunchRunSuccess { run { runId } }
    ... on RunConfigValidationInvalid { errors { message } }
    ... on Error { message }
  }
}
"""
_TERMINATE = """
mutation QoOpsTerminate($runId: String!) {
  terminateRun(runId: $runId) {
    __typename
    ... on TerminateRunFailure { message }
    ... on Error { message }
  }
}
"""
_STATUS = """
query QoOpsRunStatus($runId: ID!) {
  runOrError(runId: $runId) {
    __typename
    ... on Run { status }
  }
}
"""


class DagsterUnavailable(Exception):
    """Dagster could not be reached or refused the request; the message is one safe line."""


@dataclass(frozen=True)
class DagsterClient:
    """Dagster's webserver at ``url``; ``public_url`` is what links point at."""

    url: str
    location: str = "qo_ops.definitions"
    public_url: str | None = None
    timeout_s: float = 10.0

    def run_link(self, dagster_run_id: str) -> str:
        return f"{(self.public_url or self.url).rstrip('/')}/runs/{dagster_run_id}"

    def _call(self, query: str, variables: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        try:
            response = httpx.post(
                f"{self.url.rstrip('/')}/graphql",
                json={"query": query, "variables": variables},
                timeout=timeout_s,
            )
        except httpx.HTTPError as exc:
            raise DagsterUnavailable(f"Dagster unreachable ({type(exc).__name__})") from None
        if response.status_code != 200:
            raise DagsterUnavailable(f"Dagster answered HTTP {response.status_code}")
        body = response.json()
        if body.get("errors"):
            raise DagsterUnavailable(
                "Dagster GraphQL error: " + one_line(body["errors"][0].get("message", "?"), 200)
            )
        return dict(body["data"])

    def launch(self, job_name: str, run_config: dict[str, Any], tags: dict[str, str]) -> str:
        """Submit a run; its Dagster run id (the queue starts it when its turn comes)."""
        params = {
            "selector": {
                "repositoryLocationName": self.location,
                "repositoryName": REPOSITORY,
                "jobName": job_name,
            },
            "runConfigData": run_config,
            "executionMetadata": {"tags": [{"key": k, "value": v} for k, v in tags.items()]},
        }
        result = self._call(_LAUNCH, {"executionParams": params}, self.timeout_s)["launchRun"]
        if result["__typename"] == "LaunchRunSuccess":
            return str(result["run"]["runId"])
        detail = result.get("message") or "; ".join(
            e["message"] for e in result.get("errors") or []
        )
        raise DagsterUnavailable(
            one_line(f"Dagster refused the launch ({result['__typename']}): {detail}", 300)
        )

    def terminate(self, dagster_run_id: str) -> bool:
        """Ask Dagster to stop a run (or drop it from the queue); whether it agreed."""
        result = self._call(_TERMINATE, {"runId": dagster_run_id}, self.timeout_s)
        return bool(result["terminateRun"]["__typename"] == "TerminateRunSuccess")

    def status(self, dagster_run_id: str) -> str | None:
        """Dagster's status of a run (QUEUED, STARTED, SUCCESS, …); None if unknown or
        Dagster is unreachable (a read must not fail because Dagster is down)."""
        try:
            result = self._call(_STATUS, {"runId": dagster_run_id}, 2.0)["runOrError"]
        except DagsterUnavailable:
            return None
        return str(result["status"]) if result["__typename"] == "Run" else None
