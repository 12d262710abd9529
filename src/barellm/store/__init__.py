"""Model files on disk: pulled by name, converted once into the model store, opened from there."""
