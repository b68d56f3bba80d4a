"""What the wire refuses: `WireError`, and the deepest nesting content may have (shared by the
protobuf codec and the large-envelope reader, which the codec calls)."""

__all__ = ["WireError", "MAX_DEPTH"]

MAX_DEPTH = 64


class WireError(ValueError):
    """Content that may not travel, or bytes that do not decode to valid content."""
