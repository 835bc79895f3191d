"""What traces and runs of graphed code show after the fact: graph coverage of a profiler trace
(:mod:`.coverage`)."""

from .coverage import Coverage, graph_coverage

__all__ = ["Coverage", "graph_coverage"]
