"""Scheduling and lateness: the catalog's cron forms, which tenants a tick covers and how
partition keys name them, and how late, missed, overdue or stale a job is."""
