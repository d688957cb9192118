"""The step as a stream of sub-groups: acquire -> update -> release, with tiers overlapping I/O."""
from .step import run_subgroups

__all__ = ["run_subgroups"]
