"""Measurement: timing, statistics, numerical parity, progress of long gates."""
