// BERT's WordPiece tokenizer for ASCII texts (wordpiece.cpp): the ids the `tokenizers` library gives a text under a
// BertNormalizer (clean_text; lowercase or not) -> BertPreTokenizer -> WordPiece -> "[CLS] $A [SEP]" pipeline,
// truncated on the right. bertfast/tokenization.py builds it only for a tokenizer of exactly that shape and sends
// every other text (not ASCII, or holding an added token's text) to the library.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace bertfast {
namespace cpu {

struct WordPieceSpec {
  std::vector<std::pair<std::string, int32_t>> vocab;  // the WordPiece model's
  std::string unk_token;                               // in vocab
  std::string prefix;                                  // continuing_subword_prefix ("##")
  int32_t cls = 0, sep = 0;                            // the ids around each text
  bool lowercase = true;
  int64_t max_chars = 100;          // max_input_chars_per_word: a longer word is unk_token
  std::vector<std::string> added;   // every added token's content: a text holding one goes to the library
};

class WordPiece {
 public:
  explicit WordPiece(const WordPieceSpec& spec);

  // Appends the ids of an ASCII text ([cls], its tokens, [sep]; at most max_length of them, max_length >= 2) to
  // `out` and returns their count, or -1 (nothing appended) when the text holds an added token's content, which
  // the library matches before normalizing. scratch: the caller's buffer for the normalized text.
  int64_t encode(std::string_view text, int64_t max_length, std::vector<int64_t>& out, std::string& scratch) const;

 private:
  struct Hash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  using Map = std::unordered_map<std::string, int32_t, Hash, std::equal_to<>>;

  bool holds_added(std::string_view text, std::string_view normalized) const;
  // The ids of one pre-token (a word, or a punctuation mark) onto `pieces`: false (nothing kept) if some part
  // of it is in no vocabulary entry.
  bool split(std::string_view word, std::vector<int32_t>& pieces) const;

  Map words_;   // every entry, looked up at a word's start
  Map pieces_;  // the entries after `prefix`, looked up past a word's start
  int32_t unk_, cls_, sep_;
  bool lowercase_;
  int64_t max_chars_;
  std::vector<std::string> added_;  // lowercased
  bool first_char_[128] = {};       // some added token starts with this (lowercased) character
};

}  // namespace cpu
}  // namespace bertfast
