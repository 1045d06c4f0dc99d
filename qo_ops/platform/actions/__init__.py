"""What an operator does to jobs and runs.

The modules cover suspend and cancel (control), approvals and the consent they give, the
recovery of dead letters, reviews and checkpoints, and the status table."""
