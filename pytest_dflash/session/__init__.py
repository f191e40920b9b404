"""One pytest session of gates: state, collection, fixtures, environment, policy."""
