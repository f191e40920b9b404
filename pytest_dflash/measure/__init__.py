"""Measuring: timers, paired statistics, timing worker processes, numerics, progress."""
