"""The model families (one package each: vlbert/, vilbert/), what they share (common/) and the registry that is
the one way to them from the rest of the library (registry.py)."""
