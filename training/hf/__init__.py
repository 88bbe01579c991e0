"""Hugging Face checkpoints in and out of Flowstate's own model code (families, weights, import/export)."""
