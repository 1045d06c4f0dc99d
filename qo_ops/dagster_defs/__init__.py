"""The Dagster code location (``workspace.yaml``). Jobs, schedules, sensors and checks are
derived from the job catalog once the platform has one; today it defines nothing."""

from __future__ import annotations

import dagster as dg

defs = dg.Definitions()
