"""The archive's format.

Audit records are copied out of PostgreSQL (``COPY … TO STDOUT`` as CSV, parsed by Arrow),
written as Parquet, and read back. The module also defines the digest of rows. PostgreSQL
computes it from its own values, and Arrow computes it from a file's, each on its own.
"""

from __future__ import annotations

import array
import hashlib
import io
from collections.abc import Sequence
from functools import cache
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from qo_ops.db.schema import audit_record
from qo_ops.jobs.audit_archive.errors import ArchiveError

if TYPE_CHECKING:  # pyarrow is loaded by the functions that use it, never on import
    import pyarrow as pa

# An archive run converts no Python value to Arrow (pa.array, pa.scalar, a str or int
# argument to a compute function) and no zoned timestamp to Python (as_py()). pyarrow's
# first such conversion imports pandas when it is installed, which the run never needs
# (figures in bench/TUNING.md). Arrays of Python values are built from their bytes instead
# (_int_array, _text). Only read_rows, for a restore, makes Python datetimes, and pays there.

# The file's columns are every column of audit_record, with ``details`` as JSON text.
COLUMNS = (
    "id", "tenant_id", "occurred_at", "actor_ref", "action", "entity_type", "entity_id", "details",
)  # fmt: skip
assert tuple(c.name for c in audit_record.columns) == COLUMNS, "archive columns drifted"


@cache
def load_arrow() -> None:
    """Import the parts of pyarrow this package uses, and run each of its conversions once.

    The rows used are enough to start what a batch's tables start: a CSV parsed as COPY
    writes it, a Parquet file written and read back, and both digests. Their first call sets
    up kernels, threads, buffers and codecs, which no batch should pay for while it holds
    row locks (figures in bench/TUNING.md). This runs once per process, and is free after.
    """
    ids = list(range(1, 2_001))
    csv = "".join(
        f'{i},t,2000-01-01T00:00:{i % 60:02}.{i:06}Z,a,"b,""c""",e,{i},"{{""n"": {i}}}",2000-01-01\n'
        for i in ids
    )
    table = rows_of_csv(io.BytesIO(csv.encode()), ids)
    data = parquet_bytes(table.drop_columns(["day"]), {"warm_up": "1"})
    table_digests(read_table(data, use_threads=False))


@cache
def archive_schema() -> pa.Schema:
    """Return the file's Arrow schema, ``COLUMNS``, each NOT NULL as in the table."""
    import pyarrow as pa

    text = pa.string()
    types = (pa.int64(), text, pa.timestamp("us", tz="UTC"), text, text, text, text, text)
    return pa.schema([pa.field(n, t, nullable=False) for n, t in zip(COLUMNS, types, strict=True)])


# Which rows an archive takes. The copy into the file (COPY_BATCH) and the delete from the
# source (DELETE_DIGESTED) share this one predicate, and that sharing is the safety. A delete
# can reach only rows of the tenant that the copy could have put in a file. The id range lets
# the primary key serve both. The copy keeps exactly the selected ids of it (copy_batch), and
# the delete stands only if it took exactly the file's rows.
ARCHIVE_ROWS = "tenant_id = :t AND id BETWEEN :lo AND :hi"

# Copy the selected rows' id range as the archive holds it, as CSV straight into Arrow
# columns, with no Python object per value. occurred_at is ISO 8601 UTC with microseconds,
# which Arrow parses exactly. details is jsonb's own text form, which casts back exactly. The
# UTC day comes last. The copy goes by the id range because COPY takes no bind parameters,
# and a literal of every id costs the server a parse and a plan per batch. copy_batch keeps
# the selected ids of it. Rows come in id order, and copy_batch sorts them by day in Arrow
# rather than by a server sort that spills.
COPY_BATCH = sa.text(
    f"""
    COPY (SELECT id, tenant_id,
                 to_char(occurred_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'),
                 actor_ref, action, entity_type, entity_id, details::text,
                 (occurred_at AT TIME ZONE 'UTC')::date::text AS day
            FROM audit_record
           WHERE {ARCHIVE_ROWS}
           ORDER BY id)
      TO STDOUT WITH (FORMAT csv)
    """
)


# The batch's claim in one statement (``Batching.claims``): the runner's selection of the
# next batch (``{selection}``: the eligible records, by day then id, with its LIMIT and
# ``FOR UPDATE SKIP LOCKED``) locks the records, and the same COPY writes exactly those out,
# as COPY_BATCH does. Their ids make no round trip through Python, and the copy takes no
# record of the id range that was not selected.
COPY_CLAIMED = """
    COPY (SELECT id, tenant_id,
                 to_char(occurred_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'),
                 actor_ref, action, entity_type, entity_id, details::text,
                 (occurred_at AT TIME ZONE 'UTC')::date::text AS day
            FROM audit_record
           WHERE id = ANY(array(SELECT claimed.id FROM ({selection}) AS claimed))
             AND tenant_id = :t
           ORDER BY id)
      TO STDOUT WITH (FORMAT csv)
    """


def copy_batch(conn: Connection, ids: Sequence[int], tenant_id: str) -> pa.Table:
    """Run ``COPY_BATCH`` in the caller's transaction for the tenant's records among ``ids``.

    It returns an Arrow table of ``archive_schema()`` with a trailing ``day`` column (ISO
    date, UTC), sorted by day, then id.
    """
    params = {"lo": min(ids), "hi": max(ids), "t": tenant_id}
    return rows_of_csv(_copy_out(conn, COPY_BATCH, params), ids)


def copy_claimed(
    conn: Connection, statement: sa.TextClause, params: dict[str, Any]
) -> pa.Table | None:
    """Run ``COPY_CLAIMED`` (with its selection in, ``statement``) in the caller's
    transaction. It returns what ``copy_batch`` returns, for the records it locked, or None
    when it locked none."""
    csv = _copy_out(conn, statement, params)
    return rows_of_csv(csv, None) if csv.getbuffer().nbytes else None


def _copy_out(conn: Connection, statement: sa.TextClause, params: dict[str, Any]) -> io.BytesIO:
    """Run a ``COPY … TO STDOUT`` in the caller's transaction and return its bytes."""
    # PostgreSQL's COPY takes no bind parameters, so psycopg's copy() merges them into the
    # text client-side, as literals it quotes itself. These are the package's statements run
    # that way. They are compiled here from SQLAlchemy's :name to psycopg's %(name)s.
    compiled = statement.compile(dialect=conn.dialect)
    raw = conn.connection.driver_connection
    assert raw is not None
    buffer = io.BytesIO()
    with raw.cursor() as cur, cur.copy(str(compiled), compiled.construct_params(params)) as copy:
        for block in copy:
            buffer.write(block)
    buffer.seek(0)
    return buffer


def rows_of_csv(csv: io.BytesIO, ids: Sequence[int] | None) -> pa.Table:
    """Parse the CSV of ``COPY_BATCH`` or ``COPY_CLAIMED`` as an Arrow table, sorted by day,
    then id.

    With ``ids``, only their rows are kept, and all of them must be there.
    """
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pacsv

    copy_schema = archive_schema().append(pa.field("day", pa.string()))  # what COPY_BATCH yields
    table = pacsv.read_csv(
        csv,
        read_options=pacsv.ReadOptions(column_names=copy_schema.names),
        parse_options=pacsv.ParseOptions(newlines_in_values=True),
        convert_options=pacsv.ConvertOptions(
            column_types={f.name: f.type for f in copy_schema},
            strings_can_be_null=False,
            quoted_strings_can_be_null=False,
        ),
    )
    table = table.cast(copy_schema)  # NOT NULL as in the table, where none can be
    if ids is not None:
        selected = _int_array(ids, "q")
        # Rows of the range that were not selected (another run's, or not eligible) stay out.
        table = table.filter(pc.is_in(table.column("id"), value_set=selected))
        if table.num_rows != len(selected):  # this transaction locked them: none can be missing
            raise ArchiveError(f"copied {table.num_rows} of {len(selected)} selected records")
    return table.sort_by([("day", "ascending"), ("id", "ascending")]).combine_chunks()


def _int_array(values: Sequence[int], code: str) -> pa.Array:
    """Build an Arrow int64 (``code`` "q") or int32 ("i") array of Python ints from their bytes."""
    import pyarrow as pa

    packed = array.array(code, values)
    kind = {8: pa.int64(), 4: pa.int32()}[packed.itemsize]
    return pa.Array.from_buffers(kind, len(packed), [None, pa.py_buffer(packed)])


def _text(value: str) -> pa.Scalar:
    """Build an Arrow string scalar of a Python string from its bytes."""
    import pyarrow as pa

    data = value.encode()
    offsets = pa.py_buffer(array.array("i", [0, len(data)]))
    return pa.Array.from_buffers(pa.string(), 1, [None, offsets, pa.py_buffer(data)])[0]


def same_text(column: pa.ChunkedArray, value: str) -> bool:
    """Return whether every value of a string column equals ``value``."""
    import pyarrow.compute as pc

    return bool(pc.all(pc.equal(column, _text(value))).as_py())


def parquet_bytes(table: pa.Table, metadata: dict[str, str]) -> bytes:
    """Write the archive file for ``table`` (``archive_schema()`` columns) as bytes."""
    import pyarrow.parquet as pq

    schema = archive_schema().with_metadata({f"qo_ops.{k}": v for k, v in metadata.items()})
    buffer = io.BytesIO()
    pq.write_table(table.select(list(COLUMNS)).cast(schema), buffer, compression="zstd")
    return buffer.getvalue()


def read_table(data: bytes, *, use_threads: bool = True) -> pa.Table:
    """Read an archive file's bytes as a table of ``archive_schema()``. Raise if unreadable.

    One batch's file reads faster on one thread than the pool's threads start up.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    reader = pq.ParquetFile(pa.BufferReader(data))  # pq.read_table would load pyarrow.dataset
    table = reader.read(use_threads=use_threads)
    if tuple(table.column_names) != COLUMNS:
        raise ValueError(f"unexpected columns {table.column_names}")
    return table.cast(archive_schema()).combine_chunks()


def read_rows(data: bytes) -> list[tuple[Any, ...]]:
    """Return the rows of an archive file's bytes in ``COLUMNS`` order. Raise if unreadable."""
    table = read_table(data)
    return list(zip(*(table.column(c).to_pylist() for c in COLUMNS), strict=True))


# ------------------------------------------------------------------------ the rows' digest

# Delete the manifest's source rows. PostgreSQL digests the rows it deleted from its own
# values, exactly as table_digests() digests a file's rows. The digest is their count, the
# sha256 of the ids joined by ",", and the sha256 of one line per row in id order. A line is
# the id, the epoch µs, then each text column as <bytes>:<text>, with "|" between fields and
# "\n" after each. The length prefix means no two different rows give the same line.
# This runs under a savepoint (steps.delete_verified). The delete stands only if the digests
# equal the file's. Otherwise the savepoint is rolled back, so nothing of it is committed
# unless the deleted rows are, value for value, the file's.
# The rows are ARCHIVE_ROWS within the manifest's window, which is what the copy could take.
# Twice: once this commits, the rows are gone and the manifest is VERIFIED. No run can make
# it VERIFIED again (steps._MARK_VERIFIED), so a second run never gets here for it.
DELETE_DIGESTED = sa.text(
    f"""
    WITH gone AS (
        DELETE FROM audit_record
         WHERE {ARCHIVE_ROWS} AND occurred_at >= :ws AND occurred_at < :we
        RETURNING id, occurred_at, tenant_id, actor_ref, action, entity_type, entity_id,
                  details::text AS details  -- jsonb's text once per row, not twice
    )
    SELECT count(*) AS n,
           encode(sha256(convert_to(coalesce(string_agg(id::text, ',' ORDER BY id), ''),
                                    'UTF8')), 'hex') AS ids,
           encode(sha256(convert_to(coalesce(string_agg(
                      id::text
                      || '|' || (extract(epoch FROM occurred_at) * 1000000)::bigint::text
                      || '|' || octet_length(tenant_id) || ':' || tenant_id
                      || '|' || octet_length(actor_ref) || ':' || actor_ref
                      || '|' || octet_length(action) || ':' || action
                      || '|' || octet_length(entity_type) || ':' || entity_type
                      || '|' || octet_length(entity_id) || ':' || entity_id
                      || '|' || octet_length(details) || ':' || details
                      || E'\\n', '' ORDER BY id), ''), 'UTF8')), 'hex') AS rows
      FROM gone
    """
)
# The text columns of a line, in DELETE_DIGESTED's order.
_TEXT_COLUMNS = ("tenant_id", "actor_ref", "action", "entity_type", "entity_id", "details")


def _joined_sha256(pieces: pa.Array) -> str:
    """Return the sha256 of the concatenation of a string array's values."""
    import pyarrow as pa
    import pyarrow.compute as pc

    whole = pa.ListArray.from_arrays(_int_array([0, len(pieces)], "i"), pieces)
    return hashlib.sha256(pc.binary_join(whole, _text(""))[0].as_buffer()).hexdigest()


def table_digests(table: pa.Table) -> tuple[str, str]:
    """Return (ids digest, rows digest) of an archive table, as ``DELETE_DIGESTED`` does."""
    import pyarrow as pa
    import pyarrow.compute as pc

    ids = pc.cast(table.column("id"), pa.string()).combine_chunks()
    id_list = pa.ListArray.from_arrays(_int_array([0, len(ids)], "i"), ids)
    ids_sha = hashlib.sha256(pc.binary_join(id_list, _text(","))[0].as_buffer()).hexdigest()
    micros = pc.cast(pc.cast(table.column("occurred_at"), pa.int64()), pa.string())
    texts = []
    for name in _TEXT_COLUMNS:
        col = table.column(name)
        length = pc.cast(pc.binary_length(col), pa.string())
        texts.append(pc.binary_join_element_wise(length, col, _text(":")))
    line = pc.binary_join_element_wise(ids, micros, *texts, _text("|"))
    line = pc.binary_join_element_wise(line, _text(""), _text("\n"))  # each line ends in \n
    return ids_sha, _joined_sha256(pa.chunked_array(line).combine_chunks())
