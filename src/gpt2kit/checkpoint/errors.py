"""Errors raised while reading or loading checkpoints."""


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated, corrupt or in a form we cannot read.

    The message names the offending file and, where there is one, the tensor.
    """
