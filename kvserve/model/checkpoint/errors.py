"""The one error a checkpoint (a directory or a GGUF file) raises when kvserve cannot run it."""


class ModelLoadError(ValueError):
    """A checkpoint is missing, malformed or unsupported; the message says what and where.

    A ValueError subclass so callers that treat bad input uniformly (the CLI,
    the server) need no torch-specific handling.
    """
