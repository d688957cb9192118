"""Benchmarks behind ``tierstate bench``, run on a user's own machine: each command module
(``step``, ``io``, ``e2e``, ``overhead``) exposes ``add_arguments(parser)`` and
``main(args) -> int`` and also runs as ``python -m tierstate.bench.<name>``. Comparisons that
need peers installed apart (DeepSpeed's end-to-end modes) and the planner's accuracy runs are
scripts in the source tree's ``benchmarks/`` folder, not part of the package."""
