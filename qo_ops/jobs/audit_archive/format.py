"""The archive's format: audit records copied out of PostgreSQL (``COPY … TO STDOUT`` as CSV,
parsed by Arrow), written as Parquet, read back; and the digest of rows that PostgreSQL
computes from its own values and Arrow from a file's, each on its own."""

from __future__ import annotations

import hashlib
import io
from collections.abc import Sequence
from functools import cache
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from qo_ops.db.schema import audit_record

if TYPE_CHECKING:  # pyarrow is imported where a table is built: the catalog does not load it
    import pyarrow as pa

# The file's columns: every column of audit_record, ``details`` as JSON text.
COLUMNS = (
    *("id", "tenant_id", "occurred_at", "actor_ref", "action", "entity_type", "entity_id"),
    "details",
)
assert tuple(c.name for c in audit_record.columns) == COLUMNS, "archive columns drifted"


@cache
def archive_schema() -> pa.Schema:
    """The file's Arrow schema (``COLUMNS``), built on first use."""
    import pyarrow as pa

    return pa.schema(
        [
            pa.field("id", pa.int64(), nullable=False),
            pa.field("tenant_id", pa.string(), nullable=False),
            pa.field("occurred_at", pa.timestamp("us", tz="UTC"), nullable=False),
            pa.field("actor_ref", pa.string(), nullable=False),
            pa.field("action", pa.string(), nullable=False),
            pa.field("entity_type", pa.string(), nullable=False),
            pa.field("entity_id", pa.string(), nullable=False),
            pa.field("details", pa.string(), nullable=False),
        ]
    )


@cache
def _copy_schema() -> pa.Schema:
    """What COPY_BATCH yields: ``archive_schema()`` and the UTC day."""
    import pyarrow as pa

    return archive_schema().append(pa.field("day", pa.string()))


# Which rows an archive takes. The copy into the file (COPY_BATCH) and the delete from the
# source (steps._DELETE_ARCHIVED) share this one predicate, and that they share it is the
# safety: a delete can reach only rows of the tenant that the copy could have put in a file.
ARCHIVE_ROWS = "id = ANY(CAST(:ids AS bigint[])) AND tenant_id = :t"

# The selected rows as the archive holds them, copied out as CSV straight into Arrow columns
# (no Python object per value): occurred_at as ISO 8601 UTC with microseconds, which Arrow
# parses exactly; details as jsonb's own text form, which casts back exactly; then the UTC
# day. In index order: sorted by day in Arrow (copy_batch), not by a server sort that spills.
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


def copy_batch(conn: Connection, ids: Sequence[int], tenant_id: str) -> pa.Table:
    """The tenant's records among ``ids`` as an Arrow table of ``archive_schema()`` and a
    trailing ``day`` column (ISO date, UTC), sorted by day, then id: ``COPY_BATCH`` in the
    caller's transaction."""
    import pyarrow.csv as pacsv

    # PostgreSQL's COPY takes no bind parameters: psycopg's copy() merges them into the text
    # client-side, as literals it quotes itself. This is the package's one statement run that
    # way; compiled here from SQLAlchemy's :name to psycopg's %(name)s.
    compiled = COPY_BATCH.compile(dialect=conn.dialect)
    params = compiled.construct_params({"ids": list(ids), "t": tenant_id})
    raw = conn.connection.driver_connection
    assert raw is not None
    buffer = io.BytesIO()
    with raw.cursor() as cur, cur.copy(str(compiled), params) as copy:
        for block in copy:
            buffer.write(block)
    buffer.seek(0)
    table = pacsv.read_csv(
        buffer,
        read_options=pacsv.ReadOptions(column_names=_copy_schema().names),
        parse_options=pacsv.ParseOptions(newlines_in_values=True),
        convert_options=pacsv.ConvertOptions(
            column_types={f.name: f.type for f in _copy_schema()},
            strings_can_be_null=False,
            quoted_strings_can_be_null=False,
        ),
    )
    table = table.cast(_copy_schema())  # NOT NULL as in the table (none can be)
    return table.sort_by([("day", "ascending"), ("id", "ascending")]).combine_chunks()


def parquet_bytes(table: pa.Table, metadata: dict[str, str]) -> bytes:
    """The archive file for ``table`` (``archive_schema()`` columns), as bytes."""
    import pyarrow.parquet as pq

    schema = archive_schema().with_metadata({f"qo_ops.{k}": v for k, v in metadata.items()})
    buffer = io.BytesIO()
    pq.write_table(table.select(list(COLUMNS)).cast(schema), buffer, compression="zstd")
    return buffer.getvalue()


def read_table(data: bytes) -> pa.Table:
    """An archive file's bytes as a table of ``archive_schema()`` (raises if unreadable)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(pa.BufferReader(data))
    if tuple(table.column_names) != COLUMNS:
        raise ValueError(f"unexpected columns {table.column_names}")
    return table.cast(archive_schema()).combine_chunks()


def read_rows(data: bytes) -> list[tuple[Any, ...]]:
    """The rows of an archive file's bytes, in ``COLUMNS`` order (raises if unreadable)."""
    table = read_table(data)
    return list(zip(*(table.column(c).to_pylist() for c in COLUMNS), strict=True))


# ------------------------------------------------------------------------ the rows' digest

# The manifest's source rows, locked (nobody changes them until the delete commits), digested
# from PostgreSQL's own values exactly as table_digests() digests a file's rows: their count;
# sha256 of the ids joined by ","; sha256 of one line per row in id order — id|epoch µs|then
# each text column as <bytes>:<text>, "|" between fields, "\n" after each: length-prefixed,
# so no two different rows give the same line.
SOURCE_DIGEST = sa.text(
    """
    WITH locked AS (
        SELECT * FROM audit_record
         WHERE tenant_id = :t AND id BETWEEN :lo AND :hi
           AND occurred_at >= :ws AND occurred_at < :we
         ORDER BY id
           FOR UPDATE
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
                      || '|' || octet_length(details::text) || ':' || details::text
                      || E'\\n', '' ORDER BY id), ''), 'UTF8')), 'hex') AS rows
      FROM locked
    """
)
# The text columns of a line, in SOURCE_DIGEST's order.
_TEXT_COLUMNS = ("tenant_id", "actor_ref", "action", "entity_type", "entity_id", "details")


def _joined_sha256(pieces: pa.Array) -> str:
    """sha256 of the concatenation of a string array's values."""
    import pyarrow as pa
    import pyarrow.compute as pc

    whole = pa.ListArray.from_arrays(pa.array([0, len(pieces)], pa.int32()), pieces)
    return hashlib.sha256(pc.binary_join(whole, "")[0].as_buffer()).hexdigest()


def table_digests(table: pa.Table) -> tuple[str, str]:
    """(ids digest, rows digest) of an archive table, as ``SOURCE_DIGEST`` computes them."""
    import pyarrow as pa
    import pyarrow.compute as pc

    ids = pc.cast(table.column("id"), pa.string()).combine_chunks()
    id_list = pa.ListArray.from_arrays(pa.array([0, len(ids)], pa.int32()), ids)
    ids_sha = hashlib.sha256(pc.binary_join(id_list, ",")[0].as_buffer()).hexdigest()
    micros = pc.cast(pc.cast(table.column("occurred_at"), pa.int64()), pa.string())
    texts = []
    for name in _TEXT_COLUMNS:
        col = table.column(name)
        length = pc.cast(pc.binary_length(col), pa.string())
        texts.append(pc.binary_join_element_wise(length, col, ":"))
    line = pc.binary_join_element_wise(ids, micros, *texts, "|")
    line = pc.binary_join_element_wise(line, pa.scalar(""), "\n")  # each line ends in \n
    return ids_sha, _joined_sha256(pa.chunked_array(line).combine_chunks())
