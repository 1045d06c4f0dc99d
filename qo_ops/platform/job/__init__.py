"""The job's vocabulary: what a job declares (``JobSpec``), the scope it runs on, the options
of one run, what a batch returns and what a run sums up to. It is plain data, and it imports
nothing else of qo_ops but its error classes. Every other package builds on it."""
