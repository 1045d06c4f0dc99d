"""Scheduling and lateness.

This package reads the catalog's cron forms. It says which tenants a tick covers and how
partition keys name them. It also judges how late, missed, overdue or stale a job is."""
