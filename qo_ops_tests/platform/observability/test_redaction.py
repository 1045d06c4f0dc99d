"""Secrets and personal data never survive the log path: random text carrying API tokens,
bearer values, passwords in URLs, ``password=``-like pairs and e-mail addresses goes
through the real loggers and handlers (job events, the API's and the exporter's JSON
lines, one-line errors); none of the secret parts comes out.

Tests the redaction in ``qo_ops.platform.observability.events`` and ``qo_ops.errors``.
"""

from __future__ import annotations

import io
import json
import logging
import string
import uuid

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qo_ops.errors import QoOpsError, one_line
from qo_ops.platform.observability.events import (
    EVENT_LOGGER,
    EventContext,
    json_log_handler,
    log_event,
)

ALNUM = string.ascii_letters + string.digits
# "Zq" marks a secret: no public part (hex token ids, lowercase domains, short user names,
# the noise around it) can contain a whole one by chance
secret_text = st.text(alphabet=ALNUM, min_size=10, max_size=22).map(lambda s: "Zq" + s)
noise = st.text(alphabet=ALNUM + " .,:;-_/()[]'\"=", max_size=16)


@st.composite
def carrier(draw):
    """(text with a secret inside, the secret part that must not come out)."""
    kind = draw(st.sampled_from(["token", "bearer", "url", "kv", "email"]))
    secret = draw(secret_text)
    if kind == "token":
        token_id = draw(st.text(alphabet="0123456789abcdef", min_size=16, max_size=16))
        tail = "Zq" + draw(st.text(alphabet=ALNUM + "-_", min_size=41, max_size=41))
        inner, secret = f"qoops_{token_id}_{tail}", tail
    elif kind == "bearer":
        inner = f"Authorization: Bearer {secret}"
    elif kind == "url":
        scheme = draw(st.sampled_from(["postgresql", "postgresql+psycopg", "https", "redis"]))
        user = draw(st.text(alphabet=ALNUM, min_size=1, max_size=8))
        inner = f"{scheme}://{user}:{secret}@db.internal:5432/qo"
    elif kind == "kv":
        key = draw(
            st.sampled_from(["password", "PASSWORD", "secret", "token", "api_key", "apikey"])
        )
        sep = draw(st.sampled_from(["=", ": ", " = ", "="]))
        quote = draw(st.sampled_from(["", "'", '"']))
        inner = f"{key}{sep}{quote}{secret}{quote}"
    else:
        domain = draw(st.text(alphabet=string.ascii_lowercase, min_size=2, max_size=10))
        tld = draw(st.sampled_from(["com", "io", "co.uk", "example"]))
        inner = secret = f"{secret}@{domain}.{tld}"
    return f"{draw(noise)} {inner} {draw(noise)}", secret


def _capture(logger_name: str) -> tuple[logging.Logger, io.StringIO, logging.Handler]:
    stream = io.StringIO()
    handler = json_log_handler(stream)
    logger = logging.getLogger(logger_name)
    logger.addHandler(handler)
    return logger, stream, handler


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(carrier(), carrier())
def test_no_secret_survives_any_log_path(first, second):
    (text_a, secret_a), (text_b, secret_b) = first, second
    outputs = []

    # 1. job events, as the runner emits them (fields, nested values, a secret-named key)
    events, stream, handler = _capture(EVENT_LOGGER)
    try:
        ctx = EventContext("quote_expiration", str(uuid.uuid4()), "manual", "tenant-001", "execute")
        ctx.emit(
            "job.failed",
            logging.ERROR,
            note=text_a,
            detail={"error": text_b, "items": [text_a, {"why": text_b}]},
            password=secret_b,
        )
    finally:
        events.removeHandler(handler)
    outputs.append(stream.getvalue())

    # 2. the API's and the exporter's loggers: structured events and plain messages
    for name in ("qo_ops.api", "qo_ops.metrics"):
        logger, stream, handler = _capture(name)
        logger.setLevel(logging.INFO)
        try:
            log_event(logger, logging.WARNING, "api.launch_failed", error=text_a, client=text_b)
            logger.warning("plain %s then %s", text_a, text_b)
            logger.error(f"formatted {text_b} {text_a}")
        finally:
            logger.removeHandler(handler)
        outputs.append(stream.getvalue())

    # 3. one-line errors shown to users
    outputs.append(str(QoOpsError(f"cannot connect: {text_a}; {text_b}")))
    outputs.append(one_line(f"{text_b}\n{text_a}"))

    everything = "\n".join(outputs)
    assert secret_a not in everything and secret_b not in everything
    for line in outputs[0].splitlines() + outputs[1].splitlines():
        json.loads(line)  # still one JSON object per line
