"""mpcomm.nn: a small numpy/CuPy layer library with explicit, functional backward passes.

``y, ctx = m.forward(x)``; ``gx = m.backward(gy, ctx)``; gradients accumulate in ``Parameter.grad``.
"""
from .backend import array_module, to_numpy
from .layers import (GELU, Dropout, Embedding, Identity, LayerNorm, Linear, ReLU, Residual, Sequential,
                     TransformerMLPBlock)
from .losses import cross_entropy, mse_loss
from .models import mlp, transformer_mlp_stack
from .module import Module, Parameter, RemovableHandle
from .optim import SGD, Adam, Optimizer, clip_grad_norm_, make_optimizer

__all__ = [
    "array_module", "to_numpy", "Module", "Parameter", "RemovableHandle",
    "Identity", "Linear", "Embedding", "LayerNorm", "GELU", "ReLU", "Dropout", "Sequential", "Residual",
    "TransformerMLPBlock", "mse_loss", "cross_entropy", "mlp", "transformer_mlp_stack",
    "Optimizer", "SGD", "Adam", "clip_grad_norm_", "make_optimizer",
]
