"""evalkit: accuracy evaluation harness for KV-cache compression (SnapStream, arXiv 2511.03092)."""

__version__ = "0.1.0"
