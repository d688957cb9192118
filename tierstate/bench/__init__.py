"""Benchmarks behind ``tierstate bench``: each module exposes ``add_arguments(parser)``
and ``main(args) -> int`` and also runs as ``python -m tierstate.bench.<name>``."""
