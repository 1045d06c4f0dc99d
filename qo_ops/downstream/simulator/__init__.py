"""A real HTTP service standing in for the downstream fulfilment system and notification sink.

It keeps its own state in a SQLite file (never the qo-ops PostgreSQL tables) and injects
faults on demand, so jobs that call other systems can be tested against real HTTP:

* outage: every fulfilment/notification request is answered ``503 {"error": "outage"}``
  (``outage="503"``) or its connection is dropped at once (``outage="refuse"``), nothing
  stored;
* rate limit: beyond ``rate_limit`` requests a second (a token bucket over the
  fulfilment/notification endpoints), ``429 {"error": "rate_limited"}`` with a
  ``Retry-After`` in whole seconds, nothing stored;
* latency: every fulfilment/notification request that passes the two above waits
  ``latency_ms`` first;
* poison: deterministic per idempotency key / event id (``hash(seed:key) < poison_rate``) or
  when the payload says ``"fault": "poison"``: answered 422 on every attempt, nothing stored;
* error: an injected 503, nothing stored (random per request, seeded RNG);
* timeout: the request IS stored, then the answer is delayed by ``timeout_s`` — a client
  with a shorter read timeout cannot know it went through (the unknown-outcome case);
* reset: the request IS stored, then the connection is dropped without any answer.

Admin endpoints (``/admin/...``, ``/healthz``) never see faults. ``serve()`` runs it with
uvicorn; ``qo-ops downstream`` (``qo_ops.downstream.cli``) is the command line.

Speed: the four business endpoints are plain ASGI (no framework between uvicorn and them;
Starlette serves the admin API), and the store commits once per turn of the event loop for
all the requests of that turn (each still answered only after its commit).

Its modules: ``faults.py`` (what is injected and the state deciding it per request),
``store.py`` (the SQLite state), ``business.py`` (the business endpoints), ``app.py`` (the
ASGI app, its admin API, ``serve()``).
"""

from qo_ops.downstream.simulator.app import create_app, serve
from qo_ops.downstream.simulator.faults import BURST_S, Faults

__all__ = ["BURST_S", "Faults", "create_app", "serve"]
