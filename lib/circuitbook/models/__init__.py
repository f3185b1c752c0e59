"""Models: the book's ToyTransformer and loaders for external checkpoints."""
from .loading import load_transformer_lens_checkpoint

__all__ = ["load_transformer_lens_checkpoint"]
