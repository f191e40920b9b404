"""The native op libraries: building them, loading them, and proving which code ran."""
