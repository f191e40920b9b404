"""Gate suites of pytest-dflash: one module per gate kind, generic over registered routes."""
