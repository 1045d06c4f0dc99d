"""One run, from admission to its record. Here are the runner, what it holds while it works
(the lease, the process's liveness, the checkpoint, the selection taken a batch at a time,
the stop request) and the records it writes."""
