"""Test setup: run Triton kernels in the interpreter where there is no GPU.

TRITON_INTERPRET must be set before any ``triton.jit`` decorator runs, so this happens
before the tests import the kernels.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
