"""What traces, measurements and traffic say about graphs after the fact: graph coverage of a profiler trace
(:mod:`.coverage`) and the bucket ladder for a traffic sample (:mod:`.planner`)."""

from .coverage import Coverage, graph_coverage
from .planner import BucketPlan, plan_buckets

__all__ = ["Coverage", "graph_coverage", "BucketPlan", "plan_buckets"]
