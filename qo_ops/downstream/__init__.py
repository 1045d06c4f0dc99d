"""The downstream fulfilment system and notification sink: an HTTP simulator with fault
injection (``simulator``, ``qo-ops downstream``) and the client qo-ops calls it with."""

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
