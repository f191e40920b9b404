"""Routes and families: the registry, the shipped stack, the gate vocabulary."""
