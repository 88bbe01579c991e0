"""Semantic code search for agents: syntax-aware chunks, a shared per-snapshot index, fork overlays.

``semantic_search(*, sandbox, query, k)`` is what the ``semantic_search`` tool calls, in product
tasks and RL rollouts alike.
"""

from sandboxes.semantic.config import SemanticSearchConfig, SemanticSearchError
from sandboxes.semantic.search import format_hits, index_build_cancel, index_build_start, semantic_search

__all__ = ["SemanticSearchConfig", "SemanticSearchError", "format_hits", "index_build_cancel", "index_build_start",
           "semantic_search"]
