"""What a run tells the outside world.

This package holds structured events and run metrics, traces, and the process resource that
they are tagged with."""
