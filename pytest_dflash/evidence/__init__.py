"""Evidence of a run: the report and its schema, verdicts, and every rendering of them."""
