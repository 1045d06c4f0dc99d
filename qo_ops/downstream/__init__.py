"""The downstream fulfilment system and notification sink: an HTTP simulator with fault
injection (``simulator``, ``qo-ops downstream``) and the client qo-ops calls it with."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qo_ops.downstream.client import (
        DeliveryResult,
        DownstreamClient,
        DownstreamError,
        DownstreamOrder,
        client_from_env,
    )

__all__ = [
    "DeliveryResult",
    "DownstreamClient",
    "DownstreamError",
    "DownstreamOrder",
    "client_from_env",
]


def __getattr__(name: str) -> Any:
    """The client's names, loaded on first use: ``qo-ops downstream`` (its ``cli`` module,
    inside this package) does not load the client, SQLAlchemy or httpx for ``--help``."""
    if name in __all__:
        return getattr(importlib.import_module("qo_ops.downstream.client"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
