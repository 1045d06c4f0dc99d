"""What a run tells the outside: structured events and run metrics, traces, and the process
resource they are tagged with."""
