"""How long `qo-ops demo-data --tenants 10 --quotes 100000` takes (1,000,000 quotes, and
the 100,000 stored objects of its temp files, written into a temporary QO_OPS_HOME).

Baseline, in the same run on the same server: the plainest possible INSERT … SELECT of
1,000,000 constant quote rows into the same indexed table — what writing the biggest table
costs with no data generation at all. The ratio says how far the full load (every table,
anomalies included) is from that.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import sqlalchemy as sa

from bench.common import REPO, fresh_database, print_table, stopwatch

TENANTS, QUOTES = 10, 100_000
BASELINE_SQL = """
INSERT INTO tenant (id, name) VALUES ('tenant-001', 'baseline');
INSERT INTO quote (id, tenant_id, quote_number, customer_ref, status, total_amount,
                   price_book_version, created_at, updated_at, expires_at)
SELECT i, 'tenant-001', 'Q-' || i, 'c', 'ACTIVE', 1, 1, now(), now(), now()
FROM generate_series(1, {n}) AS i;
"""


def main() -> None:
    total_quotes = TENANTS * QUOTES
    with fresh_database("qo_ops_bench_baseline") as url:
        engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
        with stopwatch() as baseline, engine.begin() as conn:
            conn.exec_driver_sql(BASELINE_SQL.format(n=total_quotes))
        engine.dispose()

    with (
        fresh_database("qo_ops_bench_demo") as url,
        tempfile.TemporaryDirectory(prefix="qo-ops-bench-home-") as home,
    ):
        env = {
            **os.environ,
            "QO_OPS_DATABASE_URL": url.set(drivername="postgresql").render_as_string(
                hide_password=False
            ),
            "QO_OPS_HOME": home,  # the load stores a file per temp file row: not in yours
        }
        qo_ops = str(Path(sys.executable).with_name("qo-ops"))
        with stopwatch() as load:
            proc = subprocess.run(
                [qo_ops, "demo-data", "--tenants", str(TENANTS), "--quotes", str(QUOTES), "--json"],
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
        if proc.returncode != 0:
            raise SystemExit(f"demo-data failed: {proc.stderr.strip()}")
        report = json.loads(proc.stdout)

    rows_total = sum(report["rows"].values())
    print_table(
        f"demo-data --tenants {TENANTS} --quotes {QUOTES} ({time.strftime('%Y-%m-%d %H:%M')})",
        ["measure", "rows", "seconds", "rows/s"],
        [
            [
                "baseline: 1M constant quote rows",
                total_quotes,
                baseline[0],
                total_quotes / baseline[0],
            ],
            ["demo-data: every table (CLI wall time)", rows_total, load[0], rows_total / load[0]],
            ["demo-data: quotes only", total_quotes, load[0], total_quotes / load[0]],
        ],
    )
    print(
        f"\nratio demo-data wall time / baseline: {load[0] / baseline[0]:.2f}x "
        f"for {rows_total / total_quotes:.1f}x the rows"
    )
    out = REPO / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "demo_data.json").write_text(
        json.dumps(
            {
                "baseline_seconds": baseline[0],
                "load_seconds": load[0],
                "rows": report["rows"],
                "objects": report["objects"],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
