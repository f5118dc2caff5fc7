// Token files as shards: llm.c shards (header + uint16 / uint32 tokens), headerless uint16 and
// uint32 ids, raw bytes; lists and glob patterns of them. Files are read with pread, window by
// window: nothing is mapped, so a file truncated or replaced while training is an error naming
// it, never a SIGBUS.
#include <fcntl.h>
#include <fmt/core.h>
#include <glob.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <utility>

#include "lockstep/data.h"
#include "lockstep/error.h"

namespace lockstep {
namespace {

static_assert(std::endian::native == std::endian::little,
              "token files are little-endian; add a byte swap for this host");

// llm.c's dev/data/data_common.py: a header of 256 int32, then the tokens.
constexpr int64_t kLlmcHeaderBytes = 256 * 4;
constexpr int32_t kLlmcGpt2Magic = 20240520, kLlmcGpt2Version = 1;     // uint16 tokens
constexpr int32_t kLlmcLlama3Magic = 20240801, kLlmcLlama3Version = 7; // uint32 tokens
constexpr int64_t kProbeTokens = 65536;  // checked against the vocabulary when opened

bool has_glob_chars(const std::string& p) { return p.find_first_of("*?[") != std::string::npos; }

bool ends_with(const std::string& s, const char* tail) {
  const size_t n = std::strlen(tail);
  return s.size() >= n && s.compare(s.size() - n, n, tail) == 0;
}

// Files, with glob patterns expanded by glob(3) in sorted order. A path that names an existing
// file is that file, even when it holds glob characters ('x[1].bin' is not 'x1.bin').
std::vector<std::string> expand(const std::vector<std::string>& paths, const std::string& key) {
  std::vector<std::string> files;
  for (const std::string& p : paths) {
    std::error_code ec;
    if (!has_glob_chars(p) || std::filesystem::exists(p, ec)) {
      files.push_back(p);
      continue;
    }
    glob_t g{};
    const int rc = ::glob(p.c_str(), GLOB_ERR, nullptr, &g);
    if (rc == 0)
      for (size_t i = 0; i < g.gl_pathc; ++i) files.emplace_back(g.gl_pathv[i]);
    ::globfree(&g);
    if (rc != 0)
      throw InputError(fmt::format("{} pattern '{}' matches no file{}; check {}", key, p,
                                   rc == GLOB_NOMATCH ? "" : " (a directory could not be read)",
                                   key));
  }
  if (files.empty()) throw InputError(fmt::format("{} names no file; set {}", key, key));
  return files;
}

// An open file descriptor, closed when dropped.
struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  Fd(Fd&& o) noexcept : fd(std::exchange(o.fd, -1)) {}
  Fd(const Fd&) = delete;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// Reads exactly n bytes at offset, or says why not.
std::string pread_all(int fd, uint8_t* out, size_t n, off_t offset) {
  size_t got = 0;
  while (got < n) {
    const ssize_t r = ::pread(fd, out + got, n - got, offset + static_cast<off_t>(got));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return std::strerror(errno);
    if (r == 0) return "end of file";
    got += static_cast<size_t>(r);
  }
  return "";
}

// Opens a regular file for reading (a FIFO or directory is refused, never waited on).
Fd open_regular(const std::string& path, const std::string& key, off_t* bytes) {
  // O_NONBLOCK: a FIFO with no writer is refused below instead of blocking the open.
  Fd f(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  if (f.fd < 0)
    throw InputError(fmt::format("cannot open data file '{}': {}; set {} to a readable token "
                                 "file",
                                 path, std::strerror(errno), key));
  struct stat st {};
  if (::fstat(f.fd, &st) != 0 || !S_ISREG(st.st_mode))
    throw InputError(fmt::format("data file '{}' is not a regular file; set {} to a token file",
                                 path, key));
  ::fcntl(f.fd, F_SETFL, ::fcntl(f.fd, F_GETFL) & ~O_NONBLOCK);
  if (st.st_size == 0)
    throw InputError(fmt::format("data file '{}' is empty; point {} at a file with tokens", path,
                                 key));
  *bytes = st.st_size;
  return f;
}

// The llm.c header's magic, version and token count; nullopt-like magic 0 for a file that is
// too short to hold one.
std::array<int32_t, 3> llmc_header(int fd, off_t bytes) {
  std::array<int32_t, 3> h{0, 0, 0};
  if (bytes < 12) return h;
  if (!pread_all(fd, reinterpret_cast<uint8_t*>(h.data()), sizeof h, 0).empty()) return {0, 0, 0};
  return h;
}

bool is_llmc_magic(int32_t m) { return m == kLlmcGpt2Magic || m == kLlmcLlama3Magic; }

// The layout of one llm.c shard, checked against its size.
Shard llmc_shard(const std::string& path, const std::array<int32_t, 3>& h, off_t bytes) {
  const bool gpt2 = h[0] == kLlmcGpt2Magic;
  if (!is_llmc_magic(h[0]))
    throw InputError(fmt::format(
        "data file '{}' is not an llm.c shard: it starts with {}, not the magic {} (gpt-2) or {} "
        "(llama-3); set data.format to \"uint16\", \"uint32\" or \"bytes\" for headerless files",
        path, h[0], kLlmcGpt2Magic, kLlmcLlama3Magic));
  const int32_t version = gpt2 ? kLlmcGpt2Version : kLlmcLlama3Version;
  if (h[1] != version)
    throw InputError(fmt::format("llm.c shard '{}': version {} with magic {}; this reader knows "
                                 "version {} (re-create the shard with llm.c's data scripts)",
                                 path, h[1], h[0], version));
  Shard s{path, h[2], kLlmcHeaderBytes, gpt2 ? 2 : 4,
          gpt2 ? "llm.c gpt-2 (uint16)" : "llm.c llama-3 (uint32)"};
  const off_t expected = kLlmcHeaderBytes + static_cast<off_t>(h[2]) * s.width;
  if (h[2] <= 0 || bytes != expected)
    throw InputError(fmt::format(
        "llm.c shard '{}': its header says {} tokens ({} bytes with the header) but the file has "
        "{} bytes; was it truncated or is it still being written? re-create it",
        path, h[2], expected, bytes));
  return s;
}

// What one file is, from data.format and the file itself.
Shard describe_file(const std::string& path, int fd, off_t bytes, TokenFormat format,
                    const std::string& key, std::vector<std::string>& warnings) {
  const auto h = llmc_header(fd, bytes);
  if (format == TokenFormat::kLlmc || (format == TokenFormat::kAuto && is_llmc_magic(h[0])))
    return llmc_shard(path, h, bytes);
  if (format == TokenFormat::kAuto) format = ends_with(path, ".bin") ? TokenFormat::kUint16
                                                                     : TokenFormat::kBytes;
  std::string shown(name_of(format));
  if (is_llmc_magic(h[0])) {
    shown += ", its llm.c header as tokens";
    warnings.push_back(fmt::format("data file '{}' starts with an llm.c header but data.format = \"{}\" "
                                   "reads its 1024 header bytes as tokens; set data.format = "
                                   "\"llmc\" (or \"auto\")",
                                   path, name_of(format)));
  } else if (format == TokenFormat::kBytes && ends_with(path, ".bin"))
    warnings.push_back(fmt::format("data file '{}' is read as raw bytes (data.format = "
                                   "\"bytes\"); a .bin of token ids needs \"uint16\", \"uint32\" "
                                   "or \"llmc\"",
                                   path));
  const int width = format == TokenFormat::kUint32 ? 4 : format == TokenFormat::kUint16 ? 2 : 1;
  if (bytes % width != 0)
    throw InputError(fmt::format("data file '{}' has {} bytes, not a multiple of {} as {} tokens "
                                 "need; set data.format to the file's format",
                                 path, bytes, width, name_of(format)));
  return Shard{path, bytes / width, 0, width, shown};
}

class FileSource final : public TokenSource {
 public:
  FileSource(std::vector<Fd> fds, std::vector<Shard> shards, std::vector<std::string> warnings,
             int64_t vocab)
      : fds_(std::move(fds)), vocab_(vocab) {
    shards_ = std::move(shards);
    warnings_ = std::move(warnings);
  }

  void read(int64_t shard, int64_t start, int64_t n, int64_t* out) const override {
    const Shard& s = shards_[static_cast<size_t>(shard)];
    std::vector<uint8_t>& buf = buffer();
    buf.resize(static_cast<size_t>(n * s.width));
    const off_t offset = static_cast<off_t>(s.header_bytes + start * s.width);
    const std::string problem = pread_all(fds_[static_cast<size_t>(shard)].fd, buf.data(),
                                          buf.size(), offset);
    if (!problem.empty())
      throw InputError(fmt::format("data file '{}' could not be read at byte {} ({}); was it "
                                   "truncated or replaced while training? restore it and resume",
                                   s.name, offset, problem));
    for (int64_t i = 0; i < n; ++i) out[i] = token(buf.data(), s.width, i);
    for (int64_t i = 0; i < n; ++i)
      if (out[i] >= vocab_)
        throw InputError(fmt::format(
            "data file '{}': token id {} at token {} (byte {}) is >= model.vocab_size = {}; "
            "raise model.vocab_size or check data.format (this file is read as {})",
            s.name, out[i], start + i, offset + i * s.width, vocab_, s.format));
  }

  // Bytes on disk, or wider ids that read() guarantees are below a byte vocabulary (the
  // byte-level llm.c shards `lockstep data shard` writes).
  bool byte_level() const override {
    return vocab_ <= 256 ||
           std::all_of(shards_.begin(), shards_.end(), [](const Shard& s) { return s.width == 1; });
  }

 private:
  static int64_t token(const uint8_t* p, int width, int64_t i) {
    if (width == 1) return p[i];
    if (width == 2) {
      uint16_t v;
      std::memcpy(&v, p + 2 * i, 2);
      return v;
    }
    uint32_t v;
    std::memcpy(&v, p + 4 * i, 4);
    return v;
  }
  // Per thread: read() may be called from several threads at once.
  static std::vector<uint8_t>& buffer() {
    thread_local std::vector<uint8_t> b;
    return b;
  }

  std::vector<Fd> fds_;
  int64_t vocab_;
};

}  // namespace

std::unique_ptr<TokenSource> open_token_files(const std::vector<std::string>& paths,
                                              TokenFormat format, int64_t vocab_size,
                                              const std::string& key) {
  std::vector<Fd> fds;
  std::vector<Shard> shards;
  std::vector<std::string> warnings;
  for (const std::string& path : expand(paths, key)) {
    off_t bytes = 0;
    fds.push_back(open_regular(path, key, &bytes));
    shards.push_back(describe_file(path, fds.back().fd, bytes, format, key, warnings));
  }
  auto source = std::make_unique<FileSource>(std::move(fds), std::move(shards),
                                             std::move(warnings), vocab_size);
  std::vector<int64_t> probe;
  for (size_t k = 0; k < source->shards().size(); ++k) {
    probe.resize(static_cast<size_t>(std::min(kProbeTokens, source->shards()[k].tokens)));
    source->read(static_cast<int64_t>(k), 0, static_cast<int64_t>(probe.size()), probe.data());
  }
  return source;
}

int64_t TokenSource::size() const {
  int64_t n = 0;
  for (const Shard& s : shards_) n += s.tokens;
  return n;
}

std::string TokenSource::describe() const {
  if (shards_.size() == 1)
    return fmt::format("{} ({} tokens, {})", shards_[0].name, shards_[0].tokens, shards_[0].format);
  return fmt::format("{} shards, {} ... {} ({} tokens, {})", shards_.size(), shards_.front().name,
                     shards_.back().name, size(), shards_.front().format);
}

}  // namespace lockstep
