"""zenflow-triton: AdamW for models whose Adam state does not fit on the accelerator.

The important columns of each weight matrix update on the device every step; the rest
accumulate their gradient and update on the host, asynchronously, every few steps.
"""

from .config import ConfigError, ZenFlowConfig
from .fit import DoesNotFitError
from .host import HostWorkerError
from .loss import causal_lm_loss
from .optimizer import NonFiniteGradientError, OptimizerFailedError, ZenFlowOptimizer

__version__ = "0.1.0"

__all__ = ["ZenFlowOptimizer", "ZenFlowConfig", "ConfigError", "NonFiniteGradientError",
           "HostWorkerError", "OptimizerFailedError", "DoesNotFitError", "causal_lm_loss",
           "__version__"]
