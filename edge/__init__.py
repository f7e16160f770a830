"""edgefinfer: from a decoder LLM checkpoint to small, fast inference on phones and on a GPU server."""

__version__ = "0.1.0"
