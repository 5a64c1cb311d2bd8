// WordPiece for ASCII texts, the `tokenizers` library's steps on the ASCII subset (tokenizers 0.22, normalizers/
// bert.rs, pre_tokenizers/bert.rs, models/wordpiece): clean_text drops the control characters (0x00-0x1f but tab,
// newline and carriage return, which become spaces; 0x7f), lowercase maps A-Z; the pre-tokenizer splits at spaces
// and isolates each ASCII punctuation mark; WordPiece takes the longest vocabulary entry from a word's start, then
// the longest `prefix` entry from where it ended, and a word with a part no entry covers (or longer than
// max_chars) becomes unk. Accents, Chinese characters and Unicode whitespace or punctuation cannot occur in ASCII.
// tests/test_tokenization.py checks the ids against the library's on generated texts of every character class.
#include "cpu/text/wordpiece.h"

#include <algorithm>
#include <limits>

namespace bertfast {
namespace cpu {

namespace {

char lower(char c) { return c >= 'A' && c <= 'Z' ? char(c + 32) : c; }

// Rust's char::is_ascii_punctuation: ! through /, : through @, [ through `, { through ~.
bool is_punct(char c) {
  return (c >= '!' && c <= '/') || (c >= ':' && c <= '@') || (c >= '[' && c <= '`') || (c >= '{' && c <= '~');
}

std::string lowered(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = lower(c);
  return out;
}

}  // namespace

WordPiece::WordPiece(const WordPieceSpec& spec)
    : cls_(spec.cls), sep_(spec.sep), lowercase_(spec.lowercase), max_chars_(spec.max_chars) {
  words_.reserve(spec.vocab.size());
  for (const auto& [token, id] : spec.vocab) {
    words_.emplace(token, id);
    if (token.size() > spec.prefix.size() && token.compare(0, spec.prefix.size(), spec.prefix) == 0)
      pieces_.emplace(token.substr(spec.prefix.size()), id);
  }
  unk_ = words_.at(spec.unk_token);
  for (const std::string& a : spec.added) {
    if (a.empty()) continue;
    added_.push_back(lowered(a));
    const unsigned char c = static_cast<unsigned char>(added_.back()[0]);
    if (c < 128) first_char_[c] = true;
    else std::fill(std::begin(first_char_), std::end(first_char_), true);  // never in an ASCII text: be safe
  }
}

// Conservative: an added token's content in the raw or the normalized text, in any case. The library matches the
// tokens marked normalized=false in the raw text and the others in the normalized one; a text this flags that
// the library would not split is only slower, not different.
bool WordPiece::holds_added(std::string_view text, std::string_view normalized) const {
  bool maybe = false;
  for (char c : text) maybe |= first_char_[static_cast<unsigned char>(lower(c)) & 127];
  if (!maybe) return false;
  const std::string raw = lowered(text), norm = lowered(normalized);
  for (const std::string& a : added_)
    if (raw.find(a) != std::string::npos || norm.find(a) != std::string::npos) return true;
  return false;
}

bool WordPiece::split(std::string_view word, std::vector<int32_t>& pieces) const {
  const size_t kept = pieces.size();
  for (size_t start = 0; start < word.size();) {
    const Map& map = start == 0 ? words_ : pieces_;
    size_t end = word.size();
    for (; end > start; --end) {
      const auto it = map.find(word.substr(start, end - start));
      if (it != map.end()) {
        pieces.push_back(it->second);
        break;
      }
    }
    if (end == start) {
      pieces.resize(kept);
      return false;
    }
    start = end;
  }
  return true;
}

int64_t WordPiece::encode(std::string_view text, int64_t max_length, std::vector<int64_t>& out,
                          std::string& scratch) const {
  scratch.clear();
  for (char c : text) {
    const unsigned char u = static_cast<unsigned char>(c);
    if (c == '\t' || c == '\n' || c == '\r') scratch.push_back(' ');
    else if (u >= 32 && u != 127) scratch.push_back(lowercase_ ? lower(c) : c);
  }
  if (holds_added(text, scratch)) return -1;
  const size_t first = out.size();
  const int64_t limit = max_length - 2;  // tokens of the text itself, as the library truncates
  out.push_back(cls_);
  int64_t count = 0;
  std::vector<int32_t> pieces;
  const std::string_view s(scratch);
  for (size_t i = 0; i < s.size() && count < limit;) {
    if (s[i] == ' ') {
      ++i;
      continue;
    }
    size_t j = i + 1;
    if (!is_punct(s[i]))
      while (j < s.size() && s[j] != ' ' && !is_punct(s[j])) ++j;
    const std::string_view word = s.substr(i, j - i);
    i = j;
    pieces.clear();
    if (int64_t(word.size()) > max_chars_ || !split(word, pieces)) pieces.assign(1, unk_);
    for (size_t p = 0; p < pieces.size() && count < limit; ++p, ++count) out.push_back(pieces[p]);
  }
  out.push_back(sep_);
  return int64_t(out.size() - first);
}

}  // namespace cpu
}  // namespace bertfast
