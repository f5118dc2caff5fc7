// Small text helpers of the readers of user input (config keys, fault specs, id lists).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace lockstep {

// The candidate closest to `wanted` by edit distance, or "" when none is plausibly a typo.
std::string nearest(std::string_view wanted, const std::vector<std::string>& candidates);

// Splits "a, b ,c" at commas, trimming blanks; empty items (and an empty text) give no items.
std::vector<std::string> split_list(const std::string& text);

// 8030261248 -> "8,030,261,248".
std::string with_commas(int64_t n);

// The whole of `s` as a decimal integer.
bool parse_int(std::string_view s, int64_t& out);

}  // namespace lockstep
