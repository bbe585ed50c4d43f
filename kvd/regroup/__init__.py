"""Regrouping KV between parallel layouts: the planner and the data movers that apply a plan."""
