"""A minimal PNG writer (8-bit RGB, zlib via the standard library) for heat maps.

Keeps `describe` free of plotting dependencies.
"""
from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np

__all__ = ["write_png", "heat_colors"]


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def write_png(path: str | Path, rgb: np.ndarray) -> None:
    """Write an H x W x 3 uint8 array as a PNG file."""
    rgb = np.ascontiguousarray(rgb, dtype=np.uint8)
    if rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"expected an H x W x 3 array, got {rgb.shape}")
    h, w, _ = rgb.shape
    rows = np.concatenate([np.zeros((h, 1), np.uint8), rgb.reshape(h, w * 3)], axis=1)  # filter 0
    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    Path(path).write_bytes(b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header)
                           + _chunk(b"IDAT", zlib.compress(rows.tobytes(), 9)) + _chunk(b"IEND", b""))


def heat_colors(values: np.ndarray) -> np.ndarray:
    """Map values in [0, 1] to RGB from white (0) through orange to dark red (1)."""
    v = np.clip(values, 0.0, 1.0)[..., None]
    stops = np.array([[255, 255, 255], [253, 174, 97], [215, 48, 39], [103, 0, 13]], dtype=np.float64)
    pos = v * (len(stops) - 1)
    lo = np.floor(pos).astype(int).clip(0, len(stops) - 2)
    frac = pos - lo
    return (stops[lo[..., 0]] * (1 - frac) + stops[lo[..., 0] + 1] * frac).round().astype(np.uint8)
