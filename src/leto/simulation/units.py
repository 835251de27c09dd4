"""Units the simulator's inputs and results are written in."""

GB = 1e9
HOUR = 3600.0
DAY = 86400.0
