"""pytest-xdist on GPUs: one GPU per worker, timing gates grouped."""
