"""What traces, measurements and traffic say about graphs after the fact: graph coverage of a profiler trace
(:mod:`.coverage`), the bucket ladder for a traffic sample (:mod:`.planner`), and the first module whose replay
differs from eager (:mod:`.divergence`)."""

from .coverage import Coverage, graph_coverage
from .divergence import Divergence, find_divergence
from .planner import BucketPlan, plan_buckets

__all__ = ["Coverage", "graph_coverage", "BucketPlan", "plan_buckets", "Divergence", "find_divergence"]
