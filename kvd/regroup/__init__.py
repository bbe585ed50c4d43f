"""Regroup: the planner's output applied to memory (kernel, host twin, torch fallback)."""
