"""Operator actions: isolate/release nodes, restore jobs, the command queue, audit and policy."""
