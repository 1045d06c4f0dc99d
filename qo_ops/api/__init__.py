"""The operator API: the authenticated, authorized and audited door for manual runs.

``tokens`` (bearer tokens, stored hashed), ``authz`` (who may do what), ``ratelimit``,
``dagster`` (launch/terminate through Dagster's GraphQL API), ``service`` (the database side
of every request) and ``app`` (the HTTP surface, FastAPI).
"""
