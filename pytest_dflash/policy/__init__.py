"""The ground floor of predeclared choices: gate thresholds and profile sizes (no torch)."""
