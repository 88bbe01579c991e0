"""Policy model: typed config, MoE transformer, slot-based KV cache."""

from training.model.config import ModelConfig, ModelConfigError
from training.model.kv_cache import KVCache
from training.model.transformer import MoETransformer, TransformerOutput

__all__ = ["KVCache", "MoETransformer", "ModelConfig", "ModelConfigError", "TransformerOutput"]
