"""The torch.optim front: optimizers, their update rules, the gradient stream."""
from .base import OffloadOptimizer
from .optimizers import SGD, Adagrad, Adam, AdamW, Lion

__all__ = ["OffloadOptimizer", "Adam", "AdamW", "SGD", "Lion", "Adagrad"]
