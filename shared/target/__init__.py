"""The frozen target as both stages see it: loading and hidden-state capture, its identity, its exported pieces."""
