// `_C.WordPiece` (bertfast/tokenization.py builds it): the ASCII WordPiece tokenizer of csrc/cpu/text/wordpiece.cpp on a
// list of Python strings, read in place (an ASCII str's characters are its UTF-8 bytes) and encoded with the GIL
// released; bound in csrc/bindings.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <pybind11/pybind11.h>

#include <cstring>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "bindings/checks.h"
#include "cpu/text/wordpiece.h"

namespace py = pybind11;

namespace bertfast {
namespace bindings __attribute__((visibility("hidden"))) {

class WordPiece {
 public:
  explicit WordPiece(const cpu::WordPieceSpec& spec) : impl_(spec) {}

  // texts: a list of str -> (ids (total,) int64: each text's ids one after the other; lengths (N,) int64: each
  // text's count, -1 for a text left to the library (not ASCII, or holding an added token's content)).
  std::tuple<at::Tensor, at::Tensor> encode(const py::list& texts, int64_t max_length) const {
    BF_CHECK(max_length >= 2, "max_length must leave room for the two special tokens, got ", max_length);
    const int64_t n = int64_t(texts.size());
    std::vector<std::string_view> views(n);
    at::Tensor lengths = at::empty({n}, at::kLong);
    int64_t* len = lengths.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      PyObject* s = texts[i].ptr();
      BF_CHECK(PyUnicode_Check(s), "text ", i, " is not a string");
      len[i] = PyUnicode_IS_ASCII(s) ? 0 : -1;
      if (len[i] == 0) views[i] = std::string_view(static_cast<const char*>(PyUnicode_DATA(s)), PyUnicode_GET_LENGTH(s));
    }
    std::vector<int64_t> ids;
    {
      py::gil_scoped_release released;  // `texts` holds the strings
      std::string scratch;
      for (int64_t i = 0; i < n; ++i)
        if (len[i] == 0) len[i] = impl_.encode(views[i], max_length, ids, scratch);
    }
    at::Tensor flat = at::empty({int64_t(ids.size())}, at::kLong);
    if (!ids.empty()) std::memcpy(flat.data_ptr<int64_t>(), ids.data(), ids.size() * sizeof(int64_t));
    return {flat, lengths};
  }

 private:
  cpu::WordPiece impl_;
};

}  // namespace bindings
}  // namespace bertfast
