"""The interpreter fix of `bertfast.kernels.triton._common`: Triton 3.6 and earlier turn a scalar tensor used as
a Python index (a loop's runtime bound) into an int with `int(data)` on a one-element array, which NumPy >= 2.4
refuses; every kernel with such a loop failed there (151 of tests/ops/triton under Triton 3.4 and 3.6 with NumPy
2.4.6, none with the fix). The Triton installed here may be one that needs no fix, so the interpreter's tensor
patch is replaced by each version's form of it: the fix must wrap both old forms and leave the fixed one alone.
"""

from __future__ import annotations

import operator

import numpy as np
import pytest

pytest.importorskip("triton")
from triton.runtime import interpreter  # noqa: E402

from bertfast.kernels.triton import _common  # noqa: E402


def patch_3_6(tensor, scope):  # Triton 3.6's form (a scope that restores)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))


def patch_3_4(tensor):  # Triton 3.4 and earlier: set for good
    tensor.__index__ = lambda self: int(self.handle.data)


def patch_fixed(tensor, scope):  # Triton 3.9
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))


def fake_tensor_class():
    class Handle:
        data = np.array([7], dtype=np.int32)  # a loaded scalar: shape (1,)

    class Tensor:
        handle = Handle()

    return Tensor


@pytest.mark.skipif(not hasattr(interpreter, "_LangPatchScope"),
                    reason="this Triton's interpreter sets its patches for good (3.4 and earlier): no scoped form")
def test_wraps_the_scoped_form_and_restores_with_it(monkeypatch):
    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch_3_6)
    assert _common._interpreter_index_fix()
    tensor, scope = fake_tensor_class(), interpreter._LangPatchScope()  # the scope Triton 3.6 and 3.9 restore with
    interpreter._patch_lang_tensor(tensor, scope)
    assert operator.index(tensor()) == 7 and list(range(tensor())) == list(range(7))
    scope.restore()
    assert "__index__" not in tensor.__dict__


def test_wraps_the_unscoped_form(monkeypatch):
    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch_3_4)
    assert _common._interpreter_index_fix()
    tensor = fake_tensor_class()
    interpreter._patch_lang_tensor(tensor)
    assert operator.index(tensor()) == 7


def test_leaves_a_fixed_interpreter_alone(monkeypatch):
    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch_fixed)
    assert not _common._interpreter_index_fix()
    assert interpreter._patch_lang_tensor is patch_fixed


@pytest.mark.skipif(tuple(int(p) for p in np.__version__.split(".")[:2]) < (2, 4),
                    reason="NumPy before 2.4 still converts a one-element array to an int")
def test_the_unwrapped_form_fails_under_this_numpy():
    tensor = fake_tensor_class()
    patch_3_4(tensor)
    with pytest.raises(TypeError, match="0-dimensional"):
        operator.index(tensor())
