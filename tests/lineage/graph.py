"""The lineage graph a list of OpenLineage events draws: each run's inputs lead to its outputs."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

Node = tuple[str, str]  # (namespace, name)


def descendants(events: list[dict[str, Any]], start: Node) -> set[Node]:
    """Every dataset some chain of runs leads to from ``start``."""
    edges: dict[Node, set[Node]] = defaultdict(set)
    for event in events:
        for source in event["inputs"]:
            edges[source["namespace"], source["name"]].update((d["namespace"], d["name"]) for d in event["outputs"])
    seen: set[Node] = set()
    frontier = [start]
    while frontier:
        for node in edges[frontier.pop()] - seen:
            seen.add(node)
            frontier.append(node)
    return seen
