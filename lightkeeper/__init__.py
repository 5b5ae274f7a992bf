"""Lightkeeper: observability, debugging and auto-eviction for torchft training jobs."""

__version__ = "0.1.0"
