"""cascade-service: Cascade Speculative Drafting as a service."""

__version__ = "0.1.0"
