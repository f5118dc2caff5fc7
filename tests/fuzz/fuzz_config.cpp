// The config loader's contract under any input: a valid Config or a ConfigError whose message
// is one line; nothing else escapes, nothing crashes (ASan and UBSan watch), and a loaded
// Config's TOML loads again into the same Config. The input is TOML text, or, when it starts
// with '@', a command-line override "--KEY VALUE" for one of a set of keys of every kind.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "lockstep/config.h"
#include "lockstep/error.h"

namespace {

void check_one_line(const std::exception& e) {
  if (std::string_view(e.what()).find('\n') != std::string_view::npos) {
    std::fprintf(stderr, "multi-line error: %s\n", e.what());
    std::abort();
  }
}

constexpr const char* kKeys[] = {
    "training.steps",   "training.seq_len",      "optimizer.lr",        "model.dim",
    "parallelism.mode", "parallelism.bucket_mb", "skip.enabled",        "skip.window",
    "fault.inject",     "fault.random_kinds",    "fault.poison_ids",    "data.format",
    "checkpoint.load_step", "lr_scheduler.decay_type", "job.dump_folder", "comm.train_timeout_seconds"};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  try {
    lockstep::Config c;
    if (size >= 2 && input[0] == '@') {
      const char* key = kKeys[static_cast<uint8_t>(input[1]) % (sizeof kKeys / sizeof *kKeys)];
      c = lockstep::load_config("", "fuzz", {{key, std::string(input.substr(2))}});
    } else {
      c = lockstep::load_config(input, "fuzz.toml");
    }
    const std::string text = lockstep::to_toml(c);
    if (lockstep::to_toml(lockstep::load_config(text, "round trip")) != text) {
      std::fprintf(stderr, "the resolved config does not load back into itself:\n%s\n", text.c_str());
      std::abort();
    }
  } catch (const lockstep::ConfigError& e) {
    check_one_line(e);
  }
  return 0;
}
