"""Calling another system from a job.

This package holds the calls made outside the transaction (external), their retries, the
fleet's rate limit, the circuit breaker, the call statistics, the outbox and the object
store."""
