"""The native runtime: the engine that runs a model's plan over its weights in the C executor."""
