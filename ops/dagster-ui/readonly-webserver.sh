#!/bin/sh
# The read-only Dagster UI (`make ui-readonly`): dagster-webserver --read-only over the same
# Dagster instance as `qo-ops dev` / `make ui` — DAGSTER_HOME=$QO_OPS_HOME/dagster with the
# project's dagster.yaml, storage from `qo-ops db env` (the embedded server unless
# QO_OPS_DATABASE_URL is set). Loopback only. Usage: readonly-webserver.sh [PORT] (default 3000)
#
# No daemon is started: schedules and sensors belong to the one daemon of the deployment
# (`make ui` runs one locally). Mutations (launch, backfill, terminate, schedule/sensor
# toggles, reload) are refused by the webserver itself; see ops/dagster-ui/README.md.
set -eu

port=${1:-3000}
repo=$(cd "$(dirname "$0")/../.." && pwd -P)
bin=${BIN:-$repo/.venv/bin}
case $bin in /*) ;; *) bin=$repo/$bin ;; esac

# Resolved from the caller's directory, as qo-ops resolves QO_OPS_HOME (default ./.qo_ops).
home=${QO_OPS_HOME:-.qo_ops}
mkdir -p "$home/dagster"
DAGSTER_HOME=$(cd "$home/dagster" && pwd -P)
export DAGSTER_HOME
cp "$repo/dagster.yaml" "$DAGSTER_HOME/dagster.yaml"

# Prints `export QO_OPS_DAGSTER_STORAGE_URL='…'`; starts the embedded server if needed.
# (Assigned first so that a failing qo-ops stops the script: `eval "$(false)"` succeeds.)
exports=$("$bin/qo-ops" db env)
eval "$exports"

echo "read-only Dagster UI on http://127.0.0.1:$port (DAGSTER_HOME=$DAGSTER_HOME); Ctrl-C stops it"
cd "$repo"
exec "$bin/dagster-webserver" --read-only -w workspace.yaml -h 127.0.0.1 -p "$port"
