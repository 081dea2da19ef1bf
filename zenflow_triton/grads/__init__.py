"""The gradients' way into a step: streaming them off the device in backward hooks
(``stream``), clipping by the global norm (``clipping``), and which open optimizer's hooks take
each param's gradient (``owner``)."""
