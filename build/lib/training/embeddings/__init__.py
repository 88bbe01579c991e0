"""Fine-tuning and evaluation of the code search encoder used by ``sandboxes.semantic``."""
