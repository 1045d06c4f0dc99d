"""The Prometheus exporter of job metrics derived from the database (``qo-ops metrics``)."""
