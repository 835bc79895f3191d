"""What a captured graph holds: node counts by type."""

from __future__ import annotations

import collections
import re


def graph_node_types(dot: str) -> dict[str, int]:
    """Count the nodes of a captured graph by type from its DOT dump (``graph.debug_dump(path)`` after
    capturing with ``debug=True``; the format is CUDA's ``cudaGraphDebugDotPrint``, whose node labels
    start with the node type, e.g. ``KERNEL`` or ``MEMSET``).

    Returns:
        ``{node type: count}``; empty if the text holds no recognisable node.
    """
    return dict(collections.Counter(re.findall(r'label="\{\s*([A-Z_]+)', dot)))
