// The training loop. It reads like the step it runs: fetch batch, forward, backward,
// gradient norm, update, log, checkpoint. The algorithms live in the components.
#include "lockstep/train.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <mutex>
#include <thread>

#include "checkpoint.h"
#include "fsutil.h"
#include "lockstep/data.h"
#include "lockstep/error.h"
#include "lockstep/log.h"
#include "lockstep/ranks.h"
#include "lockstep/schedule.h"
#include "metrics.h"
#include "model.h"
#include "comm.h"
#include "ddp.h"
#include "gradcheck.h"
#include "optim.h"

namespace lockstep {

c10::Device resolve_device(const std::string& name) {
  if (name == "cpu") return c10::Device(c10::kCPU);
  bool cuda = at::hasCUDA();
  if (name == "cuda" && !cuda)
    throw ConfigError(
        "invalid value for 'training.device': \"cuda\" but no CUDA device is usable (CPU-only "
        "LibTorch or no GPU); use training.device = \"cpu\" or \"auto\"");
  return cuda ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU);
}

namespace {

using Clock = std::chrono::steady_clock;

std::string format_eta(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  auto s = static_cast<int64_t>(seconds + 0.5);
  if (s >= 3600) return fmt::format("{}:{:02d}:{:02d}", s / 3600, (s / 60) % 60, s % 60);
  return fmt::format("{}:{:02d}", s / 60, s % 60);
}

std::unique_ptr<TokenSource> open_source(const DataConfig& d, int64_t vocab_size) {
  if (d.source == "synthetic") return make_synthetic_source(d.synthetic_tokens);
  return open_token_file(d.path, parse_token_format(d.format), vocab_size);
}

// (B, T + 1) token ids for the given samples, on `device`.
at::Tensor batch_tensor(const Sampler& sampler, const std::vector<int64_t>& ids, int64_t seq_len,
                        c10::Device device) {
  at::Tensor t = at::empty({static_cast<int64_t>(ids.size()), seq_len + 1}, at::kLong);
  sampler.fill(ids, t.data_ptr<int64_t>());
  return t.to(device);
}

// ", in a (3), b (1)": the tensors holding nonfinite values, most first.
std::string worst_tensors(const std::vector<NamedTensor>& grads, const GradCheckStats& s) {
  std::vector<size_t> idx;
  for (size_t i = 0; i < s.tensor_nonfinite.size(); ++i)
    if (s.tensor_nonfinite[i] > 0) idx.push_back(i);
  std::stable_sort(idx.begin(), idx.end(), [&](size_t a, size_t b) {
    return s.tensor_nonfinite[a] > s.tensor_nonfinite[b];
  });
  std::string out;
  for (size_t k = 0; k < idx.size() && k < 3; ++k)
    out += fmt::format("{}{} ({})", k ? ", " : ", in ", grads[idx[k]].name,
                       s.tensor_nonfinite[idx[k]]);
  return out;
}

// The stats every rank contributes to a step's decision: its gradient-check buffer (of the
// shard it owns) and its loss, gathered from all ranks and reduced in rank order, so that every
// rank computes the same numbers from the same inputs in the same order.
struct StepStats {
  GradCheckStats grads;  // over the whole synced gradient
  double loss = 0;       // mean over ranks
};

StepStats agree(const at::Tensor& check_buffer, double loss, Comm* comm) {
  at::Tensor mine = at::empty({check_buffer.numel() + 1}, at::kDouble);
  mine.narrow(0, 0, check_buffer.numel()).copy_(check_buffer);
  mine.data_ptr<double>()[check_buffer.numel()] = loss;
  const int w = comm ? comm->size() : 1;
  at::Tensor all = mine.unsqueeze(0);
  if (comm && w > 1) {
    all = at::empty({w, mine.numel()}, at::kDouble);
    comm->all_gather(mine, all);
  }
  at::Tensor sum = at::zeros_like(mine);
  for (int r = 0; r < w; ++r) sum.add_(all.select(0, r));  // rank order
  StepStats s;
  s.grads = GradCheck::read(sum.narrow(0, 0, check_buffer.numel()));
  s.loss = sum.data_ptr<double>()[check_buffer.numel()] / w;
  return s;
}

}  // namespace

TrainResult train(const Config& cfg) {
  const TrainingConfig& tc = cfg.training;
  const RankInfo ranks = discover_ranks();
  const bool lead = ranks.rank == 0;  // writes config, metrics, checkpoints; prints progress
  const std::string run_dir = cfg.job.dump_folder;
  fs::make_dirs(run_dir + "/logs");
  log::init(ranks.rank, fmt::format("{}/logs/rank{}.log", run_dir, ranks.rank), log::Level::kInfo,
            lead ? log::Level::kInfo : log::Level::kWarn);
  std::unique_ptr<Comm> comm;
  if (ranks.world_size > 1) {
    comm = make_comm(ranks, {"gloo", cfg.comm.init_timeout_seconds,
                             cfg.comm.train_timeout_seconds});
    log::info("rank {} of {} ({}), {} collectives, rendezvous {}:{}", ranks.rank,
              ranks.world_size, ranks.launcher, comm->backend(), ranks.master_addr,
              ranks.master_port);
  }
  if (lead) fs::write_file_atomic(run_dir + "/config.toml", to_toml(cfg));

  // 0 = this node's cores shared among its ranks.
  const int threads = tc.threads > 0 ? static_cast<int>(tc.threads)
                                     : static_cast<int>(std::thread::hardware_concurrency()) /
                                           ranks.local_world_size;
  at::set_num_threads(std::max(1, threads));
  const c10::Device device = resolve_device(tc.device);
  {
    // Dropout draws from the global generator: seed it (a resume restores its state).
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_current_seed(static_cast<uint64_t>(tc.seed));
  }

  // Data
  auto source = open_source(cfg.data, cfg.model.vocab_size);
  Sampler sampler(*source, {tc.seq_len, tc.local_batch_size, ranks.rank, ranks.world_size,
                            static_cast<uint64_t>(tc.seed)});

  // Model and optimizer
  Gpt model(cfg.model, static_cast<uint64_t>(tc.seed), device);
  // Gradients live in one flat buffer (one all-reduce); this rank checks its 1/W slice.
  DdpGradients grads(model.parameters(), comm.get());
  GradCheck check(grads.grads(), grads.shard_offset(), grads.shard_length());
  AdamW optimizer(model.parameters(),
                  {cfg.optimizer.beta1, cfg.optimizer.beta2, cfg.optimizer.eps,
                   cfg.optimizer.weight_decay, cfg.optimizer.implementation == "fused"});
  const LRScheduleOptions schedule{cfg.optimizer.lr, cfg.lr_scheduler.warmup_steps, tc.steps,
                                   cfg.lr_scheduler.decay_type, cfg.lr_scheduler.min_lr_factor};

  // Resume
  const nlohmann::json config_json = nlohmann::json::parse(to_json(cfg));
  const std::string& folder = cfg.checkpoint.folder;
  Checkpointer ckpt({folder.starts_with("/") ? folder : run_dir + "/" + folder,
                     cfg.checkpoint.keep_latest_k});
  TrainState state;
  if (cfg.checkpoint.enable && cfg.checkpoint.load_step != 0) {
    auto available = ckpt.steps();
    int64_t want = cfg.checkpoint.load_step;
    if (want > 0 && std::find(available.begin(), available.end(), want) == available.end())
      throw InputError(fmt::format(
          "checkpoint.load_step = {}: no complete checkpoint '{}'; available steps: [{}]", want,
          ckpt.dir_of(want), fmt::join(available, ", ")));
    if (want < 0 && !available.empty()) want = available.back();
    if (want > 0) {
      state = ckpt.load(want, model.parameters(), optimizer.state(), config_json);
      sampler.set_position(state.data_position);
      log::info("resumed from {} (step {}, data position {})", ckpt.dir_of(want), state.step,
                state.data_position);
    }
  }

  log::info("lockstep: {} parameters, device {}, {} threads, data: {}", model.num_parameters(),
            device.str(), at::get_num_threads(), source->describe());
  // Every rank starts from rank 0's weights (identical by construction: same seed, same
  // checkpoint; the broadcast makes it so whatever happened).
  if (comm)
    for (const auto& t : model.parameters()) {
      at::Tensor d = t.tensor.detach();
      comm->broadcast(d, 0);
    }
  log::info("optimizer AdamW ({}), {} steps, global batch {} x {} x {} ranks x {} tokens, run "
            "dir {}",
            optimizer.fused() ? "fused" : "for-loop", tc.steps, tc.local_batch_size,
            tc.gradient_accumulation_steps, ranks.world_size, tc.seq_len, run_dir);

  MetricsWriter metrics(lead ? run_dir + "/metrics.jsonl" : "");
  TrainResult result;
  result.start_step = state.step;
  const int64_t tokens_per_step =
      tc.local_batch_size * tc.seq_len * tc.gradient_accumulation_steps * ranks.world_size;
  const auto run_start = Clock::now();
  auto interval_start = run_start;
  int64_t interval_steps = 0;

  state.world_size = ranks.world_size;
  auto save = [&] {
    if (!cfg.checkpoint.enable) return;
    if (lead) {  // ddp: every rank holds the same state, rank 0 writes it
      auto dir = ckpt.save(state, model.parameters(), optimizer.state(), config_json);
      log::info("checkpoint saved: {}", dir);
    }
    if (comm) comm->barrier();
  };

  while (state.step < tc.steps) {
    const int64_t step = state.step;
    const double lr = lr_at(schedule, step);

    // Forward and backward over the micro-batches; gradients accumulate in .grad.
    double loss_sum = 0;
    for (int64_t micro = 0; micro < tc.gradient_accumulation_steps; ++micro) {
      auto ids = sampler.next_ids();
      at::Tensor batch = batch_tensor(sampler, ids, tc.seq_len, device);  // (B, T + 1)
      at::Tensor x = batch.slice(1, 0, tc.seq_len);                       // (B, T)
      at::Tensor y = batch.slice(1, 1, tc.seq_len + 1);                   // (B, T)
      at::Tensor loss = Gpt::loss(model.forward(x, /*train=*/true), y);
      loss.div(static_cast<double>(tc.gradient_accumulation_steps)).backward();
      loss_sum += loss.item<double>();
    }
    grads.average();  // one all-reduce of the flat gradient buffer

    // One fused pass over this rank's slice of the gradients, then one small collective of
    // the per-rank stats: every rank reaches the same numbers. Clipping reuses the norm
    // through the optimizer's grad_scale: no second pass.
    const StepStats agreed = agree(check.run(), loss_sum / static_cast<double>(
                                                    tc.gradient_accumulation_steps),
                                   comm.get());
    const GradCheckStats& health = agreed.grads;
    const double loss = agreed.loss;
    const double grad_norm = std::sqrt(health.sumsq);
    if (!std::isfinite(loss) || health.nonfinite > 0) {
      log::flush();
      throw TrainingAborted(fmt::format(
          "step {}: nonfinite {} (loss {}, {} nonfinite gradient elements{}); the weights were not "
          "updated and the last checkpoint is intact; lower optimizer.lr or check the data",
          step, std::isfinite(loss) ? "gradient" : "loss", loss, health.nonfinite,
          worst_tensors(grads.grads(), health)));
    }
    if (health.overflow_runs > 0)
      log::warn("step {}: gradient squares overflow fp32 (grad_norm {:.4g}); summed in fp64", step,
                grad_norm);
    const double clip = clip_coefficient(grad_norm, tc.max_norm);
    at::Tensor grad_scale;
    if (clip < 1.0)
      grad_scale = at::empty({}, model.parameters()[0].tensor.options()).fill_(1.0 / clip);
    optimizer.step(lr, grad_scale);
    optimizer.zero_grad();

    state.step += 1;
    state.optimizer_steps += 1;
    state.data_position = sampler.position();
    state.tokens_seen += tokens_per_step;
    result.losses.push_back(loss);
    ++interval_steps;

    const bool last = state.step == tc.steps;
    if (state.step % cfg.metrics.log_freq == 0 || last) {
      const auto now = Clock::now();
      const double secs = std::chrono::duration<double>(now - interval_start).count();
      const double ms_per_step = 1e3 * secs / static_cast<double>(interval_steps);
      const double tok_s = static_cast<double>(interval_steps * tokens_per_step) / secs;
      const double eta = static_cast<double>(tc.steps - state.step) * ms_per_step / 1e3;
      log::info("step {:>6}/{} | loss {:.4f} | grad_norm {:.4f} | lr {:.3e} | ms/step {:.1f} | "
                "tok/s {:.0f} | ETA {}",
                state.step, tc.steps, loss, grad_norm, lr, ms_per_step, tok_s, format_eta(eta));
      metrics.write({{"step", state.step},
                     {"loss", json_number(loss)},
                     {"grad_norm", json_number(grad_norm)},
                     {"clip_coef", clip},
                     {"lr", lr},
                     {"ms_per_step", ms_per_step},
                     {"tokens_per_s", tok_s},
                     {"tokens_seen", state.tokens_seen},
                     {"optimizer_steps", state.optimizer_steps},
                     {"elapsed_s", std::chrono::duration<double>(now - run_start).count()}});
      interval_start = now;
      interval_steps = 0;
    }
    if (state.step % cfg.checkpoint.interval == 0 || last) save();
  }

  const double total = std::chrono::duration<double>(Clock::now() - run_start).count();
  const int64_t ran = state.step - result.start_step;
  result.final_step = state.step;
  result.optimizer_steps = state.optimizer_steps;
  result.tokens_per_second = ran > 0 ? static_cast<double>(ran * tokens_per_step) / total : 0.0;
  if (ran > 0)
    log::info("done: {} steps in {:.1f} s, {:.0f} tok/s, final loss {:.4f}, parameters crc32 {}",
              ran, total, result.tokens_per_second, result.losses.back(),
              tensors_crc32(model.parameters()));
  else
    log::info("nothing to do: the run is already at step {} of {}", state.step, tc.steps);
  log::flush();
  return result;
}

}  // namespace lockstep
