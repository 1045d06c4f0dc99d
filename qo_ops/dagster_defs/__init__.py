"""The Dagster adapter: partitions, config, resources, jobs, checks, schedules and sensors,
all derived from the job catalog. No job logic lives here; every op calls ``run_job``."""
