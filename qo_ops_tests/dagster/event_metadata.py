"""What Dagster keeps of our runs, read back for privacy tests: every string and number in
the events of every run (outputs, failures, observations, materializations, check
evaluations, and their metadata, tables included) and in asset events reported without a
run (the sensors' observations); and what must never be among them, read from the demo
database itself.

    values = event_values(instance)
    leaks = find_leaks(values, forbidden_values(engine))
    assert not leaks, "\\n".join(leaks)
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import dagster as dg
import sqlalchemy as sa
from dagster._serdes import serialize_value
from sqlalchemy.engine import Engine

# Parts of an event that are not a report: a failure's Python traceback (qo-ops code, not data).
SKIPPED_KEYS = {"error", "__class__"}
PATTERNS = {
    "an API token": re.compile(r"qoops_[A-Za-z0-9]"),
    "a password": re.compile(r"passw(?:or)?d", re.IGNORECASE),
    "a connection URL": re.compile(r"\bpostgres(?:ql)?(?:\+\w+)?://", re.IGNORECASE),
    "a bearer credential": re.compile(r"\bbearer\b", re.IGNORECASE),
}
QUOTED_KEY = re.compile(r"""["']([A-Za-z_][A-Za-z0-9_]*)["']\s*:""")
MIN_REFERENCE = 6  # shorter values would match by chance

# The columns of the demo data that point at a person (opaque references, still personal).
PERSONAL_REFERENCES = sa.text(
    """
    SELECT customer_ref FROM quote
    UNION SELECT recipient_ref FROM notification
    UNION SELECT actor_ref FROM audit_record
    """
)
# The payloads the jobs move around: outbox events, fulfilment requests, cache entries, audit details.
PAYLOADS = sa.text(
    """
    SELECT payload, payload::text AS text FROM outbox_event
    UNION ALL SELECT payload, payload::text FROM delivery_attempt_item
    UNION ALL SELECT payload, payload::text FROM catalog_cache
    UNION ALL SELECT details, details::text FROM audit_record
    """
)


@dataclass(frozen=True)
class Value:
    """One string, number or mapping's key set found in an event, and where."""

    where: str
    text: str | None = None
    keys: frozenset[str] | None = None


@dataclass
class EventValues:
    """Everything found, with how many events of each type were read."""

    values: list[Value] = field(default_factory=list)
    event_types: Counter[str] = field(default_factory=Counter)
    metadata_labels: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True)
class Forbidden:
    """Values that must not appear: personal references, payload texts and their key sets."""

    references: frozenset[str]
    payload_texts: frozenset[str]
    payload_keys: tuple[frozenset[str], ...]
    secrets: frozenset[str] = frozenset()


def forbidden_values(engine: Engine, *secrets: str) -> Forbidden:
    """Read from the database every personal reference and every payload it holds;
    ``secrets`` adds strings that must never show (a password, a token)."""
    with engine.connect() as conn:
        references = frozenset(
            r for r in conn.execute(PERSONAL_REFERENCES).scalars() if len(r) >= MIN_REFERENCE
        )
        payloads = [row for row in conn.execute(PAYLOADS) if isinstance(row.payload, dict)]
    texts = set()
    key_sets = set()
    for payload, text in payloads:
        if len(payload) < 2:  # {} or a lone flag: too little to recognise
            continue
        key_sets.add(frozenset(payload))
        # as PostgreSQL prints it, and as Python would (json.dumps, compact or not)
        texts.update((text, json.dumps(payload), json.dumps(payload, separators=(",", ":"))))
    return Forbidden(
        references=references,
        payload_texts=frozenset(texts),
        payload_keys=tuple(sorted(key_sets, key=sorted)),
        secrets=frozenset(s for s in secrets if s),
    )


def _walk(node: Any, where: str) -> Iterator[Value]:
    if isinstance(node, dict):
        if node.get("__class__") == "EventMetadataEntry":  # name the entry by its label
            where = f"{where.rsplit('[', 1)[0]}[{node.get('label')}]"
        keys = frozenset(k for k in node if k not in SKIPPED_KEYS)
        if keys:
            yield Value(where, keys=keys)
        for key, value in node.items():
            if key not in SKIPPED_KEYS:
                yield from _walk(value, f"{where}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f"{where}[{i}]")
    elif isinstance(node, str):
        yield Value(where, text=node)
        stripped = node.strip()
        if stripped[:1] in ("{", "["):  # JSON inside a string (a json/text metadata value)
            try:
                inner = json.loads(stripped)
            except ValueError:
                return
            yield from _walk(inner, f"{where}<json>")
    elif isinstance(node, bool) or node is None:
        return
    elif isinstance(node, int | float):
        yield Value(where, text=str(node))


def _labels(node: Any) -> Iterator[str]:
    """Labels of the metadata entries in a serialized event."""
    if isinstance(node, dict):
        if node.get("__class__") == "EventMetadataEntry":
            yield str(node.get("label"))
        for value in node.values():
            yield from _labels(value)
    elif isinstance(node, list):
        for value in node:
            yield from _labels(value)


def _entries(instance: dg.DagsterInstance) -> Iterator[tuple[str, dg.EventLogEntry]]:
    for run in instance.get_runs():
        for record in instance.get_records_for_run(run.run_id, limit=100_000).records:
            yield f"run {run.run_id[:8]} ({run.job_name})", record.event_log_entry
    for key in instance.get_asset_keys():  # asset events reported without a run (sensors)
        for fetch in (instance.fetch_observations, instance.fetch_materializations):
            for record in fetch(key, limit=10_000).records:
                if not record.event_log_entry.run_id:  # the others were read with their run
                    yield f"asset {key.to_user_string()}", record.event_log_entry


def event_values(instance: dg.DagsterInstance) -> EventValues:
    """Every string, number and key set in the Dagster events of ``instance``."""
    found = EventValues()
    for origin, entry in _entries(instance):
        event = entry.dagster_event
        if event is None:  # a plain log line: its message
            found.event_types["LOG_MESSAGE"] += 1
            found.values.append(Value(f"{origin} log message", text=entry.user_message))
            continue
        found.event_types[event.event_type_value] += 1
        data = json.loads(serialize_value(event.event_specific_data))
        found.metadata_labels.update(_labels(data))
        where = f"{origin} {event.event_type_value}"
        found.values.extend(_walk(data, where))
        if event.message:
            found.values.append(Value(f"{where} message", text=event.message))
    return found


def find_leaks(found: EventValues, forbidden: Forbidden) -> list[str]:
    """One line per forbidden value found (empty: nothing leaked)."""
    texts = [v for v in found.values if v.text is not None]
    leaks = []
    for value in texts:
        assert value.text is not None
        for what, pattern in PATTERNS.items():
            match = pattern.search(value.text)
            if match:
                leaks.append(f"{what} ({match.group(0)!r}) in {value.where}")
        quoted = set(QUOTED_KEY.findall(value.text))
        for keys in forbidden.payload_keys:
            if keys <= quoted:
                leaks.append(f"a payload with keys {sorted(keys)} in {value.where}")
    for value in found.values:
        if value.keys is not None:
            for keys in forbidden.payload_keys:
                if keys <= value.keys:
                    leaks.append(f"a payload with keys {sorted(keys)} in {value.where}")
    # substring search over everything at once, then the place for each hit
    haystack = "\n\0".join(v.text or "" for v in texts)
    needles = [("a personal reference", r) for r in forbidden.references]
    needles += [("a payload", p) for p in forbidden.payload_texts]
    needles += [("a secret", s) for s in forbidden.secrets]
    for what, needle in needles:
        if needle in haystack:
            places = [v.where for v in texts if needle in (v.text or "")]
            shown = needle if what != "a secret" else "…"
            more = f" and {len(places) - 3} more" if len(places) > 3 else ""
            leaks.append(f"{what} ({shown!r}) in {'; '.join(places[:3])}{more}")
    return sorted(set(leaks))
