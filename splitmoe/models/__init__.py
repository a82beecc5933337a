"""Checkpoint formats: one adapter per family (`families`), streaming safetensors loading
(`loader`), and the built-in default model (`default_model`)."""
