"""The native extension, imported once under one name: `_C` (None where it is not built, with the reason)."""

from __future__ import annotations

import torch  # noqa: F401  (first: the extension links torch's libraries)

try:
    from ... import _C
except ImportError as e:  # not built (BERTFAST_NO_EXT=1, a checkout without build_ext), or built and not loading
    # (an undefined symbol, another torch's ABI): the product runs without it; the reason is kept for the tests
    _C = None
    IMPORT_ERROR: str | None = str(e)
else:
    IMPORT_ERROR = None
