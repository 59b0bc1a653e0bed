"""Multi-turn tool environments and the loop that rolls them out (docs/agentic.md)."""
