// Printable: the one escaping helper for text that came from a file or a path and is printed to a
// terminal (error lines, text reports). A hostile name must not split an error over several lines
// nor send the terminal escape sequences.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace memplan {

// The length of the UTF-8 sequence at text[i] (1 to 4), with its code point in `*code`; 0 when
// the bytes there are not UTF-8 (a stray continuation byte, a truncated or overlong sequence, a
// surrogate, a value past U+10FFFF).
inline size_t DecodeUtf8(std::string_view text, size_t i, uint32_t* code) {
  const unsigned char c = static_cast<unsigned char>(text[i]);
  if (c < 0x80) {
    *code = c;
    return 1;
  }
  const size_t length = c >= 0xc2 && c <= 0xdf   ? 2
                        : c >= 0xe0 && c <= 0xef ? 3
                        : c >= 0xf0 && c <= 0xf4 ? 4
                                                 : 0;
  if (length == 0 || i + length > text.size()) return 0;
  uint32_t value = length == 2 ? c & 0x1fu : length == 3 ? c & 0x0fu : c & 0x07u;
  for (size_t k = 1; k < length; ++k) {
    const unsigned char next = static_cast<unsigned char>(text[i + k]);
    if ((next & 0xc0) != 0x80) return 0;
    value = (value << 6) | (next & 0x3fu);
  }
  if ((length == 3 && (value < 0x800 || (value >= 0xd800 && value <= 0xdfff))) ||
      (length == 4 && (value < 0x10000 || value > 0x10ffff))) {
    return 0;
  }
  *code = value;
  return length;
}

// Code points beyond ASCII that a reader acts on although they print as nothing: the C1 controls
// (U+0080..U+009F; U+0085 NEL ends a line for YAML 1.1), the line and paragraph separators
// U+2028 and U+2029 (line breaks to YAML 1.1 and JavaScript: a comment would end there), the
// bidirectional overrides and isolates (U+202A..U+202E, U+2066..U+2069: text that reads
// differently from what it is), the byte-order mark U+FEFF, and the noncharacters U+FFFE and
// U+FFFF (which a YAML reader refuses outright).
inline bool IsInvisibleControl(uint32_t code) {
  return (code >= 0x80 && code <= 0x9f) || code == 0x2028 || code == 0x2029 ||
         (code >= 0x202a && code <= 0x202e) || (code >= 0x2066 && code <= 0x2069) ||
         code == 0xfeff || code == 0xfffe || code == 0xffff;
}

// The byte offset of the first character in `text` that a name must not hold, or npos: a C0
// control or DEL (a newline, a tab, ESC included), an IsInvisibleControl code point, or a byte
// that is not UTF-8. The readers of files that name things (a cluster's GPU, a run, a model; Note
// [JSON field reader]'s Name) refuse such names, since a name ends up in reports, configs and
// launch scripts.
inline size_t FindControlCharacter(std::string_view text) {
  for (size_t i = 0; i < text.size();) {
    uint32_t code = 0;
    const size_t length = DecodeUtf8(text, i, &code);
    if (length == 0 || code < 0x20 || code == 0x7f || IsInvisibleControl(code)) return i;
    i += length;
  }
  return std::string_view::npos;
}

// `text` with every character a terminal would act on written as an escape: C0 controls and DEL
// as \n, \r, \t or \xHH (\x1b for ESC), IsInvisibleControl's code points as \uXXXX, and bytes
// that are not UTF-8 as \xHH. The result holds no line break of any reader (shell, YAML 1.1 and
// 1.2, JSON, JavaScript), so it is also what generated text puts after a "# " (Note [Generated
// text] in planner/generated_text.h).
// Everything else, other UTF-8 included, is kept. With `keep_newlines`, '\n' and '\t' are kept (for
// a multi-line report whose own line breaks are wanted; names in it should be escaped on their
// own).
inline std::string Printable(std::string_view text, bool keep_newlines = false) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(text.size());
  auto hex_byte = [&](unsigned char c) {
    out += "\\x";
    out += kHex[c >> 4];
    out += kHex[c & 15];
  };
  size_t i = 0;
  while (i < text.size()) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c < 0x80) {
      if (c >= 0x20 && c != 0x7f) {
        out += static_cast<char>(c);
      } else if (keep_newlines && (c == '\n' || c == '\t')) {
        out += static_cast<char>(c);
      } else if (c == '\n') {
        out += "\\n";
      } else if (c == '\r') {
        out += "\\r";
      } else if (c == '\t') {
        out += "\\t";
      } else {
        hex_byte(c);
      }
      ++i;
      continue;
    }
    uint32_t code = 0;
    const size_t length = DecodeUtf8(text, i, &code);
    if (length == 0) {
      hex_byte(c);
      ++i;
      continue;
    }
    if (IsInvisibleControl(code)) {
      out += "\\u";
      for (int shift = 12; shift >= 0; shift -= 4) out += kHex[(code >> shift) & 15];
    } else {
      out.append(text.substr(i, length));
    }
    i += length;
  }
  return out;
}

}  // namespace memplan
