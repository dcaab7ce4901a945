"""A handler module that fails to import."""

raise ImportError("simulated: a dependency of this module is missing")
