"""qo-ops: the operational jobs of a Quote & Order platform, safe to run twice."""

__version__ = "0.1.0"
