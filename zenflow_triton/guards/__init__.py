"""Guards: the checks of params and gradients (``inputs``), the NaN/inf check and when it is
read (``finite_check``), and all-or-nothing steps with the failed state (``faults``)."""
