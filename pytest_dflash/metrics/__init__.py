"""Metric modules for evaluate, loaded by absolute path (never by hub name)."""
