"""Riding out a database restart: which errors mean "the server is gone for now", and a
bounded retry for the writes that must still happen afterwards (a run's final record, its
lease given back)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

from qo_ops.config import whole_number

T = TypeVar("T")
log = logging.getLogger(__name__)

DB_RETRY_ENV = "QO_OPS_DB_RETRY_S"
DEFAULT_DB_RETRY_S = 60
UNAVAILABLE = "database_unavailable"  # the error class of a run that lost its database

# SQLSTATE classes of a server going away or not accepting connections yet: 08 connection
# exception, 57P01-57P03 admin/crash shutdown and "cannot connect now" (starting up).
_GONE_SQLSTATES = ("08", "57P01", "57P02", "57P03")


def db_retry_s() -> int:
    """How long (s) a run keeps trying to write its final record and give its lease back
    while the database is unavailable (``QO_OPS_DB_RETRY_S``, default 60, 0 to 3600)."""
    return whole_number(DB_RETRY_ENV, DEFAULT_DB_RETRY_S, 0, 3600, unit="seconds")


def is_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` says the database server is unreachable or restarting (not that a
    statement was wrong): a lost connection, a refused one, a server shutting down."""
    if not isinstance(exc, DBAPIError):
        return False
    if exc.connection_invalidated or isinstance(exc, InterfaceError):
        return True
    sqlstate = getattr(exc.orig, "sqlstate", None) or ""
    if sqlstate:
        return sqlstate.startswith(_GONE_SQLSTATES)
    return isinstance(exc, OperationalError)  # no SQLSTATE: the client could not talk to it


def retry_while_unavailable(
    action: Callable[[], T],
    *,
    limit_s: float,
    what: str,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """``action()``, tried again with capped exponential backoff (0.2 s doubling to 5 s)
    while the database is unavailable, for at most ``limit_s`` seconds; then its last error
    is raised. Other errors are raised at once."""
    deadline = time.monotonic() + limit_s
    delay = 0.2
    while True:
        try:
            return action()
        except DBAPIError as exc:
            left = deadline - time.monotonic()
            if not is_unavailable(exc) or left <= 0:
                raise
            log.warning("database unavailable while %s; retrying for %.0f s more", what, left)
            sleep(min(delay, left))
            delay = min(delay * 2, 5.0)
