"""Models: the book's ToyTransformer, the model registry, loaders for external checkpoints."""
from .registry import config_from_dict, config_to_dict, register_model
from .toy import ToyConfig, ToyTransformer
from .loading import load_transformer_lens_checkpoint

__all__ = ["ToyConfig", "ToyTransformer", "config_from_dict", "config_to_dict", "load_transformer_lens_checkpoint",
           "register_model"]
