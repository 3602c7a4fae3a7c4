"""The independent oracle forms: each activation as an unfused model writes it, differentiated by torch.autograd.

Deliberately not taken from mlpfuse.activations, so that tests compare against code mlpfuse does not own.
"""

import torch
import torch.nn.functional as F

PLAIN = {
    "identity": lambda z: z,
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
    "relu": F.relu,
    "relu2": lambda z: F.relu(z) ** 2,
    "quick_gelu": lambda z: z * torch.sigmoid(1.702 * z),  # CLIP's QuickGELU as transformers writes it
}
