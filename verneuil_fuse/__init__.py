"""verneuil_fuse: replicate SQLite databases to blob storage and mount the
replicas read-only (format, store, copier, reader, CLI and Spark)."""
from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("verneuil_fuse")
except _metadata.PackageNotFoundError:  # run from a tree that was never installed
    __version__ = "0+unknown"
