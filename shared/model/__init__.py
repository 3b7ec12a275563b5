"""The drafter: its config and layers, the target head it reuses, attention, blocks and the loss."""
