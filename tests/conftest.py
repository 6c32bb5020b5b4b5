"""Test session set-up: on a machine without CUDA, Triton kernels run under its interpreter.

TRITON_INTERPRET must be set before Triton decorates the kernels, so it is set here, first.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
