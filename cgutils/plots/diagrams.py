"""Pictures of how one call runs: schematics of a mechanism (static buffers and the pool, a WHILE node) and the
pieces of a piecewise graph as a lane, drawn with matplotlib.

The measured figures are in :mod:`cgutils.plots` (the package this module sits in); these share its colours, so a graph piece is the same green in a
schematic and in a measured timeline.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import FancyBboxPatch, Patch, Rectangle

from . import COLORS


def _finish(fig, ax, title: str):
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


def pieces_lane(pieces, times=None, title: str = ""):
    """One call of a piecewise graph as a lane of boxes in replay order: graph pieces green, eager breaks grey
    (``pieces``: ``runner.pieces()``). With ``times`` (``runner.segment_times()``, column ``us``) a box's width
    is its time alone (boxes too narrow for a label go unlabelled); otherwise all boxes are equally wide."""
    widths = [float(t) for t in times.us] if times is not None else [1.0] * len(pieces)
    fig, ax = plt.subplots(figsize=(9, 2.4 if times is not None else 1.9))
    x = 0.0
    for (_, row), w in zip(pieces.iterrows(), widths, strict=True):
        graphed = row.kind == "graph"
        ax.broken_barh([(x, w)], (0, 1), color=COLORS["graph_runner"] if graphed else COLORS["eager"],
                       edgecolor="white")
        name = str(row["name"]) if graphed else ".".join(str(row["name"]).split(".")[-3:])  # fits in a box
        label = f"{'graph' if graphed else 'eager'}\n{name}" if times is None else f"{name}\n{w:.0f} µs"
        if w >= 0.07 * sum(widths):  # a narrower box cannot hold its label; the segment table has its time
            ax.text(x + w / 2, 0.5, label, ha="center", va="center", fontsize=6.5,
                    color="white" if graphed else "black")
        x += w
    ax.set_xlim(0, x)
    ax.set_ylim(0, 1)
    ax.set_yticks([])
    if times is not None:
        ax.set_xlabel("µs when each segment runs alone")
    else:
        ax.set_xticks([])  # replay order only: the boxes are equally wide
    ax.legend(handles=[Patch(color=COLORS["graph_runner"], label="graph piece (one replay)"),
                       Patch(color=COLORS["eager"], label="eager break (its module runs in Python)")],
              fontsize=7, ncol=2, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.6 if times is not None else -0.1))
    return _finish(fig, ax, title)


def _box(ax, x, y, w, h, text, color, text_color="black", fontsize=7.5):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", facecolor=color,
                                edgecolor="#333", linewidth=0.8))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize, color=text_color)


def _arrow(ax, a, b, text: str = ""):
    ax.annotate("", xy=b, xytext=a, arrowprops={"arrowstyle": "->", "color": "#333", "lw": 1})
    if text:
        ax.text((a[0] + b[0]) / 2, (a[1] + b[1]) / 2 + 0.12, text, ha="center", va="bottom", fontsize=6.5)


def static_buffers_diagram(graphs: int = 3, title: str = ""):
    """A schematic: your tensors are copied into fixed-address static input buffers, each graph's kernels read
    them and write their activations and static outputs into one shared memory pool, and the caller gets a
    clone. ``graphs``: how many graphs (one per input shape) share the pool."""
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.75 * graphs))
    top = 0.75 * graphs
    for k in range(graphs):
        y = top - 0.75 * (k + 1) + 0.15
        _box(ax, 0.0, y, 1.5, 0.5, f"your input\n(shape {k + 1})", "#dddddd")
        _box(ax, 2.2, y, 1.6, 0.5, f"static input {k + 1}\n(fixed address)", "#9ecae1")
        _box(ax, 4.4, y, 1.7, 0.5, f"graph {k + 1}: kernels\n(replayed, one launch)", COLORS["graph_runner"], "white")
        _box(ax, 8.5, y, 1.4, 0.5, f"your output {k + 1}\n(a copy)", "#dddddd")
        _arrow(ax, (1.5, y + 0.25), (2.2, y + 0.25), "copy_")
        _arrow(ax, (3.8, y + 0.25), (4.4, y + 0.25), "read")
        _arrow(ax, (6.1, y + 0.25), (6.7, y + 0.25), "write")
        _arrow(ax, (7.9, y + 0.25), (8.5, y + 0.25), "clone")  # a short label: a long one ran into the pool box
    ax.add_patch(Rectangle((6.7, 0.05), 1.2, top - 0.05, facecolor="#fdd0a2", edgecolor="#333", lw=0.8))
    ax.text(7.3, top / 2, "one shared\nmemory pool:\nactivations\nand static\noutputs\n(reused by\nevery replay)",
            ha="center", va="center", fontsize=6.5)
    ax.set_xlim(-0.1, 10.0)
    ax.set_ylim(-0.05, top + 0.1)
    ax.axis("off")
    return _finish(fig, ax, title)


def while_node_diagram(title: str = ""):
    """A schematic of a WHILE conditional node as :func:`cgutils.while_node` builds it: a kernel sets the node's
    condition from ``cond``, the node runs its body graph while the condition is non-zero, and the body ends with
    a kernel (``cg_loop_next``) that counts the iteration and sets the condition again (CUDA Programming Guide,
    "Conditional Graph Nodes"). No host in the loop."""
    fig, ax = plt.subplots(figsize=(9, 2.6))
    ax.add_patch(Rectangle((0, 0), 10, 2.2, facecolor="none", edgecolor="#333", ls="--", lw=0.8))
    ax.text(0.1, 2.05, "parent graph (one cudaGraphLaunch)", fontsize=7, va="top")
    _box(ax, 0.3, 0.8, 1.6, 0.6, "kernels before;\nflag = (cond != 0)", COLORS["graph_runner"], "white")
    ax.add_patch(Rectangle((2.6, 0.25), 5.0, 1.6, facecolor="#f0f0f0", edgecolor="#333", lw=0.8))
    ax.text(2.7, 1.75, "WHILE node: runs the body while flag != 0", fontsize=7, va="top")
    _box(ax, 3.0, 0.55, 1.8, 0.7, "body graph:\nthe body's kernels\n(they rewrite cond)", COLORS["graph_runner"], "white")
    _box(ax, 5.5, 0.55, 1.8, 0.7, "cg_loop_next:\ncount; flag =\n(cond != 0)", "#9ecae1")
    _arrow(ax, (4.8, 0.9), (5.5, 0.9))
    ax.annotate("", xy=(3.9, 0.55), xytext=(6.4, 0.55),
                arrowprops={"arrowstyle": "->", "color": "#333", "lw": 1, "connectionstyle": "arc3,rad=-0.45"})
    ax.text(5.15, 0.12, "flag != 0: again", fontsize=6.5, ha="center")
    _box(ax, 8.2, 0.8, 1.6, 0.6, "kernels after\n(flag == 0)", COLORS["graph_runner"], "white")
    _arrow(ax, (1.9, 1.1), (2.6, 1.1))
    _arrow(ax, (7.6, 1.1), (8.2, 1.1))
    ax.set_xlim(-0.1, 10.1)
    ax.set_ylim(-0.1, 2.3)
    ax.axis("off")
    return _finish(fig, ax, title)


def capture_replay_diagram(title: str = ""):
    """A schematic of notebook 02's section 1 in two rows: what runs once (warm-up, capture of kernels that are
    recorded and not run, the graph with its memory pool) and what every call does (copy the input into the static
    input, ``graph.replay()``, read or clone the static output before the next replay)."""
    fig, ax = plt.subplots(figsize=(10, 2.4))
    once = [("warm-up\n(eager calls)", "#dddddd", "black"),
            ("capture: kernels\nrecorded, not run", COLORS["graph_runner"], "white"),
            ("graph: nodes\n+ its memory pool", COLORS["graph_runner"], "white")]
    each = [("your input", "#dddddd", "black"), ("static input\n(fixed address)", "#9ecae1", "black"),
            ("graph.replay():\nall nodes, one call", COLORS["graph_runner"], "white"),
            ("static output\n(in the pool)", "#fdd0a2", "black"), ("you: read or clone\nbefore next replay", "#dddddd", "black")]
    for y, row, verbs in ((1.3, once, ["then", "gives"]), (0.1, each, ["copy_", "read", "write", ""])):
        for k, (text, color, text_color) in enumerate(row):
            _box(ax, 2.1 * k, y, 1.6, 0.6, text, color, text_color)
            if k:
                _arrow(ax, (2.1 * k - 0.5, y + 0.3), (2.1 * k, y + 0.3), verbs[k - 1])
    ax.text(-0.1, 2.05, "once (step 1, step 2)", fontsize=8, weight="bold")
    ax.text(-0.1, 0.85, "every call (step 3)", fontsize=8, weight="bold")
    ax.set_xlim(-0.2, 10.1)
    ax.set_ylim(0, 2.3)
    ax.axis("off")
    return _finish(fig, ax, title)
