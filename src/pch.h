// The one precompiled header of lockstep_core and the tests: the narrow ATen core (no
// ATen/ATen.h), fmt, nlohmann-json and the standard library pieces used everywhere.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <fmt/core.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>
