// The data readers' contract under any file: a token source whose every token is below the
// vocabulary and whose batches fill without reading out of bounds, or an InputError with a
// one-line message; the same for sample-id files and the quarantine they feed. The first input
// byte picks the format, vocabulary, sequence length and world size; the rest is the file.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "lockstep/data.h"
#include "lockstep/error.h"

namespace {

void check_one_line(const std::exception& e) {
  if (std::string(e.what()).find('\n') != std::string::npos) {
    std::fprintf(stderr, "multi-line error: %s\n", e.what());
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  static const std::string path = "/tmp/lockstep-fuzz-" + std::to_string(::getpid()) + ".bin";
  const uint8_t knobs = data[0];
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(data + 1), static_cast<std::streamsize>(size - 1));

  static constexpr lockstep::TokenFormat kFormats[] = {
      lockstep::TokenFormat::kBytes, lockstep::TokenFormat::kUint16,
      lockstep::TokenFormat::kUint32, lockstep::TokenFormat::kLlmc};
  const auto format = kFormats[(knobs & 1) | ((knobs >> 6) & 2)];
  const int64_t vocab = (knobs & 2) ? 200 : 65536;
  std::unique_ptr<lockstep::TokenSource> source;
  try {
    source = lockstep::open_token_files({path}, format, vocab);
  } catch (const lockstep::InputError& e) {
    check_one_line(e);
  }
  std::vector<int64_t> ids;
  bool have_ids = false;
  try {
    ids = lockstep::read_id_file(path);
    have_ids = true;
  } catch (const lockstep::InputError& e) {
    check_one_line(e);
  }
  if (!source) return 0;
  // Every token is below the vocabulary, or reading it is an InputError (checked per batch).
  try {
    lockstep::SamplerOptions o;
    o.seq_len = 1 + ((knobs >> 4) & 7);
    o.local_batch_size = 2;
    o.world_size = 1 + ((knobs >> 2) & 3);
    o.rank = o.world_size - 1;
    lockstep::Sampler sampler(*source, o);
    if (have_ids) sampler.set_excluded(ids, path);
    std::vector<int64_t> tokens;
    for (int step = 0; step < 3; ++step) {
      const auto batch = sampler.next_ids();
      for (int64_t id : batch)
        if (id < 0 || id >= sampler.num_samples()) std::abort();
      tokens.assign(batch.size() * static_cast<size_t>(o.seq_len + 1), -1);
      sampler.fill(batch, tokens.data());
      for (int64_t t : tokens)
        if (t < 0 || t >= vocab) std::abort();  // only reached when fill() accepted them
    }
  } catch (const lockstep::InputError& e) {
    check_one_line(e);
  }
  return 0;
}
