"""Drills: the whole pipeline under faults, load and each model family's layout, every output checked."""
