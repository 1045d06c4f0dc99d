"""The soak benchmark's Dagster code location: the project's definitions, built from the
accelerated catalog (``bench.soak_catalog``) under the location name qo_ops.definitions."""

from bench.soak_catalog import accelerate

accelerate()

from qo_ops.definitions import defs  # noqa: E402

__all__ = ["defs"]
