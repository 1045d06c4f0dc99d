"""The operator API: the authenticated, authorized and audited door for manual runs.

``tokens`` (bearer tokens, stored hashed), ``authz`` (who may do what), ``ratelimit``,
``dagster`` (launch/terminate through Dagster's GraphQL API), ``service`` (the database side
of every request), ``launch`` (handing an accepted run to Dagster), ``app`` (the HTTP
surface, FastAPI) with its ``routes`` (one module a resource), ``deps`` (what a handler is
given: the caller, the job or run in the path, the audit trail), ``handlers`` (request
framing and errors), ``models`` and ``errors`` (the shapes it speaks).
"""
