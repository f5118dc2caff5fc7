// The words for the decision's types, for lines, events and messages only: no code branches on
// them. A new reason is a bit in decide/core/rules.h and its name here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "decide/verdict.h"

namespace lockstep {

const char* decision_name(Decision d);  // "step", "skip", "abort", "clip", "salvage"
Decision decision_named(const std::string& name);  // an unknown name: throws InputError
// A reason's name (bit `bit` of core::Reason): nonfinite_grad, ..., desync.
const char* reason_name(int bit);
std::vector<std::string> reason_names(uint32_t reasons);  // in bit order
// The bits of names written by reason_names (an unknown name: throws InputError).
uint32_t reason_bits(const std::vector<std::string>& names);
// A stats row's field (core::StatsField) as RankStats names it.
const char* stats_field_name(int field);
const char* scope_name(core::Scope s);  // "local", "global" or ""
core::Scope scope_named(const std::string& name);

}  // namespace lockstep
