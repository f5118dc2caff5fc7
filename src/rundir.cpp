#include "rundir.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>

#include "checkpoint/meta.h"
#include "fsutil.h"
#include "lockstep/error.h"

namespace lockstep {

std::string hostname() {
  char buf[256] = {};
  ::gethostname(buf, sizeof buf - 1);
  return buf;
}

namespace {

std::string utc_now(const char* format) {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&t, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, format, &tm);
  return buf;
}

// What the lock file says of its holder: "host H pid P since T".
std::string holder_of(int fd) {
  char buf[512] = {};
  const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
  std::string s(buf, n > 0 ? static_cast<size_t>(n) : 0);
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s.empty() ? "an unknown process" : s;
}

}  // namespace

RunFolderLock::RunFolderLock(const std::string& run_dir) : path_(run_dir + "/.lock") {
  fs::make_dirs(run_dir);
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0)
    throw InputError(fmt::format("cannot open the run folder lock '{}': {}; choose a writable "
                                 "job.dump_folder",
                                 path_, std::strerror(errno)));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const std::string holder = holder_of(fd_);
    ::close(fd_);
    fd_ = -1;
    throw ConfigError(fmt::format(
        "the run folder '{}' is in use by another run ({}); wait for it to end, or give this "
        "run its own job.dump_folder",
        run_dir, holder));
  }
  struct stat st {};
  if (::fstat(fd_, &st) == 0 && st.st_size > 0) previous_ = holder_of(fd_);  // died holding it
  const std::string me =
      fmt::format("host {} pid {} since {}\n", hostname(), ::getpid(), utc_now("%FT%TZ"));
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, me.data(), me.size(), 0) < 0)
    throw InputError(fmt::format("cannot write the run folder lock '{}': {}", path_,
                                 std::strerror(errno)));
}

RunFolderLock::~RunFolderLock() {
  if (fd_ < 0) return;
  ::unlink(path_.c_str());  // before unlocking: the next run finds no stale holder
  ::close(fd_);
}

std::string prepare_fresh_start(const std::string& run_dir, const std::string& checkpoint_dir,
                                const std::vector<int64_t>& steps, OnExisting policy) {
  if (steps.empty()) return "";
  if (policy == OnExisting::kRefuse)
    throw ConfigError(fmt::format(
        "fresh start in '{}', which holds checkpoints of an earlier run (steps {}..{} in '{}'); "
        "run the same command with --job.on_existing archive (keeps them under {}/archive/) or "
        "--job.on_existing overwrite (deletes them), or with another --job.dump_folder; to "
        "resume the earlier run instead, leave out checkpoint.load_step (or give -1)",
        run_dir, steps.front(), steps.back(), checkpoint_dir, run_dir));
  namespace stdfs = std::filesystem;
  const std::vector<std::string> earlier = {checkpoint_dir,          run_dir + "/metrics.jsonl",
                                            run_dir + "/diagnostics", run_dir + "/logs",
                                            run_dir + "/config.toml", run_dir + "/quarantine.txt",
                                            run_dir + "/report.png"};
  if (policy == OnExisting::kOverwrite) {
    for (const auto& p : earlier) fs::remove_all(p);
    return fmt::format("job.on_existing = \"overwrite\": deleted the earlier run's checkpoints "
                       "(steps {}..{}), metrics, diagnostics and logs",
                       steps.front(), steps.back());
  }
  // One folder per archived run: two archives within a second get -2, -3, ...
  const std::string stamp = run_dir + "/archive/" + utc_now("%Y%m%dT%H%M%SZ");
  std::string archive = stamp;
  for (int n = 2; fs::exists(archive); ++n) archive = stamp + "-" + std::to_string(n);
  fs::make_dirs(archive);
  for (const auto& p : earlier) {
    if (!fs::exists(p)) continue;
    std::error_code ec;
    stdfs::rename(p, archive + "/" + stdfs::path(p).filename().string(), ec);
    if (ec)
      throw InputError(fmt::format("cannot archive '{}' into '{}': {}; move it away by hand", p,
                                   archive, ec.message()));
  }
  return fmt::format("job.on_existing = \"archive\": the earlier run (checkpoints {}..{}, "
                     "metrics, diagnostics, logs) is now in {}",
                     steps.front(), steps.back(), archive);
}

std::vector<std::string> check_resume(const nlohmann::json& saved_config, int64_t saved_world,
                                      const Config& c, int world) {
  const nlohmann::json now = nlohmann::json::parse(to_json(c));
  nlohmann::json saved = saved_config;
  // Checkpoints written before data.path became a list hold one string ("" for none).
  if (saved.contains("data") && saved["data"].contains("path") && saved["data"]["path"].is_string()) {
    const std::string one = saved["data"]["path"];
    saved["data"]["path"] = one.empty() ? nlohmann::json::array() : nlohmann::json::array({one});
  }
  auto changed = [&](const char* section, const char* key) {
    return saved.contains(section) && saved[section].contains(key) &&
           saved[section][key] != now[section][key];
  };
  auto change_text = [&](const char* section, const char* key) {
    return fmt::format("{}.{} {} -> {}", section, key, saved[section][key].dump(),
                       now[section][key].dump());
  };
  // Another model in the folder is another run, whatever else differs (issue 41: a second
  // fine-tune into the first one's folder was refused naming its seq_len or dropout).
  if (const auto model = model_differences(saved, now); !model.empty())
    throw InputError(fmt::format(
        "the run folder '{}' holds checkpoints of another model ({}); train into another "
        "job.dump_folder, or start fresh there with --checkpoint.load_step 0 "
        "--job.on_existing archive (the earlier run is kept under its archive/)",
        c.job.dump_folder, fmt::join(model, ", ")));
  std::vector<std::string> order;
  for (auto [s, k] : {std::pair{"training", "seed"}, {"training", "seq_len"}, {"data", "source"},
                      {"data", "path"}, {"data", "format"}, {"data", "synthetic_tokens"}})
    if (changed(s, k)) order.push_back(change_text(s, k));
  if (!order.empty() && !c.checkpoint.allow_data_change)
    throw ConfigError(fmt::format(
        "resume changes what the data position means ({}): the run would repeat or skip "
        "samples and no longer reproduce; resume with the checkpoint's values, or set "
        "checkpoint.allow_data_change = true to go on anyway",
        fmt::join(order, ", ")));
  std::vector<std::string> warnings;
  if (!order.empty())
    warnings.push_back(fmt::format("resume with checkpoint.allow_data_change: {}; the data "
                                   "order differs from the run's",
                                   fmt::join(order, ", ")));
  std::vector<std::string> batch;
  for (auto [s, k] : {std::pair{"training", "local_batch_size"},
                      {"training", "gradient_accumulation_steps"}})
    if (changed(s, k)) batch.push_back(change_text(s, k));
  if (saved_world != world) batch.push_back(fmt::format("world size {} -> {}", saved_world, world));
  if (batch.empty()) return warnings;
  // The samples a step takes: local batch x accumulation x ranks (4 x 3 -> 3 x 4 keeps it).
  const auto global = [](const nlohmann::json& cfg, int64_t ranks) {
    const nlohmann::json& t = cfg.at("training");
    return t.value("local_batch_size", int64_t{0}) *
           t.value("gradient_accumulation_steps", int64_t{1}) * ranks;
  };
  const int64_t before = global(saved, saved_world), after = global(now, world);
  warnings.push_back(
      before == after
          ? fmt::format("resume splits the same global batch ({} samples a step) differently "
                        "({}); the data order goes on from the same position, the run no longer "
                        "reproduces the uninterrupted one bit for bit",
                        after, fmt::join(batch, ", "))
          : fmt::format("resume changes the global batch ({} -> {} samples a step: {}); the data "
                        "order goes on from the same position, the run no longer reproduces the "
                        "uninterrupted one bit for bit",
                        before, after, fmt::join(batch, ", ")));
  return warnings;
}

}  // namespace lockstep
