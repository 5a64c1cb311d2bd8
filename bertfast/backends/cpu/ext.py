"""The native extension, imported once under one name: `_C` (None where it is not built, with the reason)."""

from __future__ import annotations

try:
    from ... import _C
except ImportError as e:  # not built (BERTFAST_NO_EXT=1, or a source checkout without build_ext)
    _C = None
    IMPORT_ERROR: str | None = str(e)
else:
    IMPORT_ERROR = None
