"""What an operator does to jobs and runs: suspend and cancel (control), approvals and the
consent they give, recovery of dead letters, reviews and checkpoints, and the status table."""
