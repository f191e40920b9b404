"""Measurement: timing, statistics, timing worker processes, numerical parity, progress of
long gates."""
