"""Narwhal: a reference router for OpenAI-compatible LLM inference engines."""

__version__ = "0.1.0"
__all__ = ["__version__"]
