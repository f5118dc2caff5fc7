#include "checkpoint/model_loader.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <filesystem>

#include "checkpoint/checkpointer.h"
#include "checkpoint/meta.h"
#include "checkpoint/reshard.h"
#include "lockstep/error.h"

namespace lockstep {
namespace {

namespace stdfs = std::filesystem;

// The step folder `path` and `step` name.
std::string step_folder(const std::string& path, int64_t step) {
  if (stdfs::exists(path + "/meta.json")) {
    if (step >= 0 && stdfs::path(path).filename() != fmt::format("step-{}", step))
      throw InputError(fmt::format("'{}' is one checkpoint, not step {}; pass its run folder to "
                                   "choose a step", path, step));
    return path;
  }
  if (!stdfs::is_directory(path))
    throw InputError(fmt::format("'{}' is not a folder; pass a run folder (job.dump_folder) or a "
                                 "checkpoint folder", path));
  std::string folder = path;
  if (stdfs::exists(path + "/config.toml")) {  // a run folder: where its checkpoints went
    const std::string f = load_config_file(path + "/config.toml").checkpoint.folder;
    folder = f.starts_with("/") ? f : path + "/" + f;
  } else if (stdfs::is_directory(path + "/checkpoint")) {  // a run folder without its config:
    folder = path + "/checkpoint";                          // checkpoint.folder's default
  }
  const Checkpointer ckpt({folder, 0});
  const auto steps = ckpt.steps();
  if (steps.empty() && !stdfs::exists(path + "/config.toml") && folder == path)
    throw InputError(fmt::format("'{}' holds no checkpoint and no config.toml (a run folder's, "
                                 "naming checkpoint.folder); pass the run folder or one of its "
                                 "checkpoint folders (checkpoint/step-N)",
                                 path));
  if (steps.empty())
    throw InputError(fmt::format("no checkpoint in '{}'; train with checkpoint.enable = true "
                                 "(checkpoint.interval sets how often one is saved)", folder));
  if (step < 0) return ckpt.dir_of(steps.back());
  for (int64_t s : steps)
    if (s == step) return ckpt.dir_of(s);
  throw InputError(fmt::format("'{}' has no checkpoint of step {}; it has step {}", folder, step,
                               fmt::join(steps, ", ")));
}

// The config a checkpoint saved (meta.json holds it as JSON: every value written as TOML).
Config saved_config(const nlohmann::json& meta, const std::string& dir) {
  std::string toml;
  for (const auto& [section, keys] : meta.at("config").items()) {
    toml += "[" + section + "]\n";
    for (const auto& [key, value] : keys.items()) toml += key + " = " + value.dump() + "\n";
  }
  return load_config(toml, dir + "/meta.json");
}

}  // namespace

CheckpointedModel load_checkpointed_model(const std::string& path, int64_t step) {
  CheckpointedModel out;
  out.dir = step_folder(path, step);
  const nlohmann::json meta = read_meta(out.dir);
  out.step = meta.at("step").get<int64_t>();
  out.config = saved_config(meta, out.dir);
  out.model = make_model(out.config.model, 0, c10::Device(c10::kCPU));
  CheckpointReader reader(out.dir, meta, out.model->parameters());
  int64_t offset = 0;
  for (const auto& p : out.model->parameters()) {
    reader.fill_weights(p.tensor, offset);
    offset += p.tensor.numel();
  }
  return out;
}

}  // namespace lockstep
