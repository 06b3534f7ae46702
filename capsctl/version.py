"""The capsctl version (one place; read by the build and the checkpoint headers)."""

__version__ = "0.2.0"
