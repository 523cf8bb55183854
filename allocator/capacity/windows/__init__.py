"""Sliding-window groups: a windowed group's release of the blocks behind every window
(`release`), the driver of one manager per group under one plan (`groups`) and the one prefix hit
every group serves a request (`hits`)."""
