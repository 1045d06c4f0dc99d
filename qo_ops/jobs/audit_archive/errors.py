"""The archive's errors. Each names the error class a failed run reports."""

from __future__ import annotations

from qo_ops.errors import ConfigError, QoOpsError

VERIFICATION_FAILED = "archive_verification_failed"


class ArchiveError(QoOpsError):
    """An archive could not be written, verified or restored, and nothing was deleted."""

    exit_code = 1
    error_code = "archive_error"


class ArchiveVerificationFailed(ArchiveError):
    """A file did not match its manifest or its source rows, so the run stops."""

    error_code = VERIFICATION_FAILED


class ArchiveConfigError(ConfigError):
    """An audit_archive setting in the environment is unusable, so nothing was run."""

    error_code = "bad_config"
