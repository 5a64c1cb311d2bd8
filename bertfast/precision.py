"""Quantized embeddings: the int8, uint8, binary and ubinary forms vector stores keep, computed as
sentence-transformers' `quantize_embeddings` computes them, so an index built with either library reads the other's.

int8 / uint8: per dimension, the range [min, max] cut into 255 equal steps (`ranges`: (2, D), from calibration
embeddings, else from the embeddings being quantized); a value's code is floor((x - min) / step) clipped to
[0, 255], minus 128 for int8. binary / ubinary: the sign bits, x > 0, packed 8 to a byte (big-endian within the
byte, as numpy.packbits), minus 128 for binary.
"""

from __future__ import annotations

import numpy as np

PRECISIONS = ("float32", "int8", "uint8", "binary", "ubinary")


def check_precision(precision: str) -> str:
    """`precision` if it is one of PRECISIONS; ValueError naming them otherwise."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


def quantization_ranges(embeddings) -> np.ndarray:
    """(2, D) float32: each dimension's minimum and maximum over `embeddings` (N, D), the int8/uint8 ranges.
    Compute them once on a sample of a corpus and pass them to every call that quantizes part of it."""
    emb = _as_float32(embeddings)
    if emb.ndim != 2 or emb.shape[0] < 2:
        raise ValueError(f"ranges need at least 2 embeddings (N, D), got shape {emb.shape}")
    return np.vstack((emb.min(axis=0), emb.max(axis=0)))


def load_ranges(path: str) -> np.ndarray:
    """The (2, D) float ranges saved at `path` (numpy.save of `quantization_ranges`); ValueError saying what is
    wrong with the file."""
    try:
        ranges = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a .npy array ({e})") from None
    if ranges.ndim != 2 or ranges.shape[0] != 2 or ranges.dtype.kind != "f":
        raise ValueError(f"{path}: need a (2, D) float array (minimum and maximum per dimension), "
                         f"got {ranges.dtype} {ranges.shape}")
    return ranges


def quantize_embeddings(embeddings, precision: str, ranges=None, calibration_embeddings=None) -> np.ndarray:
    """embeddings (N, D) or (D,) float -> the `precision` form (see the module docstring). int8/uint8 take their
    ranges from `ranges` (2, D), else from `calibration_embeddings`, else from `embeddings` themselves (at least
    2 of them: one embedding has no range)."""
    check_precision(precision)
    emb = _as_float32(embeddings)
    if precision == "float32":
        return emb
    if precision in ("binary", "ubinary"):
        packed = np.packbits(emb > 0, axis=-1)
        return packed if precision == "ubinary" else (packed.astype(np.int16) - 128).astype(np.int8)
    if ranges is None:
        ranges = quantization_ranges(emb if calibration_embeddings is None else calibration_embeddings)
    ranges = np.asarray(ranges, dtype=np.float32)
    if ranges.shape != (2, emb.shape[-1]):
        raise ValueError(f"ranges must be (2, {emb.shape[-1]}) (minimum and maximum per dimension), "
                         f"got {ranges.shape}")
    starts = ranges[0]
    steps = (ranges[1] - starts) / np.float32(255)
    steps = np.where(steps == 0, np.float32(1), steps)
    codes = np.clip(np.floor((emb - starts) / steps), 0, 255)
    return codes.astype(np.uint8) if precision == "uint8" else (codes - 128).astype(np.int8)


def _as_float32(embeddings) -> np.ndarray:
    if hasattr(embeddings, "detach"):  # a torch tensor, on any device
        embeddings = embeddings.detach().float().cpu().numpy()
    emb = np.asarray(embeddings)
    if emb.dtype.kind not in "f":
        raise ValueError(f"embeddings to quantize must be floating point, got {emb.dtype}")
    return emb.astype(np.float32, copy=False)
