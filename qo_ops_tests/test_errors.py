"""Errors are mapped to their error class by type, through one hierarchy (qo_ops.errors)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest
from sqlalchemy.exc import OperationalError

import qo_ops
from qo_ops.errors import BadInput, ClassifiedError, ConfigError, QoOpsError, error_class
from qo_ops.jobs.audit_archive.errors import ArchiveConfigError, ArchiveVerificationFailed
from qo_ops.jobs.pricing_snapshot_recalculation import NoCurrentPriceBook
from qo_ops.jobs.temp_file_cleanup import AnomalyThreshold, CleanupConfigError
from qo_ops.platform.actions.control import JobSuspended
from qo_ops.platform.calls.object_store import ObjectStoreError
from qo_ops.platform.job.options import ExecuteRefused
from qo_ops.platform.run.records import run_error_class


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (AnomalyThreshold("3 files eligible"), "anomaly_threshold"),
        (NoCurrentPriceBook("no book"), "no_current_price_book"),
        (ObjectStoreError("cannot remove"), "object_store_error"),
        (CleanupConfigError("bad"), "bad_config"),
        (ArchiveConfigError("bad"), "bad_config"),
        (ArchiveVerificationFailed("changed"), "archive_verification_failed"),
        (JobSuspended("paused"), "suspended"),
        (ExecuteRefused("no reason", error_code="reason_required"), "reason_required"),
    ],
)
def test_an_error_names_its_own_class(exc: BaseException, code: str) -> None:
    assert error_class(exc, "bad_input") == code
    assert run_error_class(exc) == code  # what a run it ends records


def test_an_error_that_names_none_takes_the_callers_default() -> None:
    for exc in (BadInput("x"), ConfigError("x"), ValueError("x")):
        assert error_class(exc, "bad_input") == "bad_input"
        assert run_error_class(exc) == "internal_error"
    assert run_error_class(OperationalError("SELECT 1", {}, Exception("boom"))) == "database_error"


def test_an_attribute_alone_does_not_make_an_error_class() -> None:
    class Foreign(Exception):
        error_code = "foreign"

    assert error_class(Foreign(), "internal_error") == "internal_error"


def _subclasses(cls: type[BaseException]) -> set[type[BaseException]]:
    found = set(cls.__subclasses__())
    for sub in list(found):
        found |= _subclasses(sub)
    return found


def test_every_error_with_a_class_is_in_the_hierarchy() -> None:
    """An error of qo_ops that declares ``error_code`` outside :class:`ClassifiedError`
    would be recorded as internal_error: none does."""
    for info in pkgutil.walk_packages(qo_ops.__path__, "qo_ops."):
        if not info.name.endswith("__main__"):  # runs the CLI
            importlib.import_module(info.name)
    strays = [
        f"{cls.__module__}.{cls.__qualname__}"
        for cls in _subclasses(BaseException)
        if cls.__module__.startswith("qo_ops.")
        and "error_code" in vars(cls)
        and not issubclass(cls, ClassifiedError)
    ]
    assert strays == []
    assert issubclass(QoOpsError, ClassifiedError)
