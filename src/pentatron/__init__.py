"""Pentatron: LLM training with 5D parallelism and a planner."""

__version__ = "0.1.0"
