"""One benchmark harness: ``python -m benchmarks`` (see ``__main__.py``)."""
