"""Errors a user can act on: each carries a one-line message and an exit code."""

from __future__ import annotations

import re

# CLI exit codes shared by every command (run summaries add their own in later layers).
EXIT_BAD_INPUT = 2

_URL_PASSWORD = re.compile(
    r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^:@/\s]*):(?P<pw>[^@/\s]*)@", re.I
)
_KV_SECRET = re.compile(
    r"((?:password|passwd|pwd|secret|token|api[_-]?key|access[_-]?key)\s*[=:]\s*)"
    r"('[^']*'|\"[^\"]*\"|[^\s,;&]+)",
    re.I,
)
_EMAIL = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}")


_API_TOKEN = re.compile(r"(qoops_[0-9a-f]{16}_)[A-Za-z0-9_-]+")
_BEARER = re.compile(r"(?i)(bearer\s+)[^\s,;\"']+")


def redact(text: str) -> str:
    """Return ``text`` with API and bearer tokens, passwords in URLs, ``password=``-like
    pairs (password, secret, token, api key) replaced by ``***`` and e-mail addresses by
    ``<email>``."""
    text = _API_TOKEN.sub(lambda m: f"{m.group(1)}***", text)
    text = _BEARER.sub(lambda m: f"{m.group(1)}***", text)
    text = _URL_PASSWORD.sub(lambda m: f"{m['scheme']}{m['user']}:***@", text)
    text = _KV_SECRET.sub(lambda m: f"{m.group(1)}***", text)
    return _EMAIL.sub("<email>", text)


def one_line(text: str, limit: int = 300) -> str:
    """Collapse ``text`` to one redacted line of at most ``limit`` characters."""
    flat = " ".join(redact(str(text)).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def first_few(names: list[str], shown: int = 5) -> str:
    """At most ``shown`` of ``names``, and how many more (``none`` when there are none)."""
    if not names:
        return "none"
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


class ClassifiedError(Exception):
    """The root of qo-ops' own errors: each class names its error class (``error_code``),
    the word a run or a refusal records for it (``job_run.last_error_code``).

    Errors are mapped by type, as httpx maps its exceptions: a subclass declares its
    ``error_code`` and :func:`error_class` finds it with ``isinstance``. A class that leaves
    it ``None`` takes the caller's default (``internal_error`` in a run, ``bad_input`` for
    a refusal)."""

    error_code: str | None = None


def error_class(exc: BaseException, default: str) -> str:
    """The error class ``exc`` declares (its :class:`ClassifiedError` ``error_code``), or
    ``default`` for any other error."""
    if isinstance(exc, ClassifiedError) and exc.error_code:
        return exc.error_code
    return default


class QoOpsError(ClassifiedError):
    """An error whose message is safe and useful to show a user as one line."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(one_line(message))
        if exit_code is not None:
            self.exit_code = exit_code


class ConfigError(QoOpsError):
    """The configuration (environment, URL, home directory) is unusable."""


class DatabaseUnavailable(QoOpsError):
    """The configured database cannot be reached."""


class SchemaNotReady(QoOpsError):
    """The database schema is not at the revision this code needs."""


class BadInput(QoOpsError):
    """A command-line or API argument is invalid; nothing was changed."""


def age_text(seconds: float) -> str:
    """A duration as a person reads it: ``45 s``, ``12 min``, ``3.5 h``, ``9.9 d``."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172_800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"
