"""Sliding-window groups: a windowed group's release of the blocks behind every window
(`release`) and the driver of one manager per group under one plan (`groups`)."""
