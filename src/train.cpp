// The training loop. It reads like the step it runs: fetch batch, forward, backward,
// gradient norm, update, log, checkpoint. The algorithms live in the components.
#include "lockstep/train.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
#include <limits>
#include <map>
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
#include "parallel.h"
#include "gradcheck.h"
#include "fault.h"
#include "optim.h"
#include "skip.h"

namespace lockstep {

c10::Device resolve_device(const std::string& name, int local_rank) {
  if (name == "cpu") return c10::Device(c10::kCPU);
  bool cuda = at::hasCUDA();
  if (name == "cuda" && !cuda)
    throw ConfigError(
        "invalid value for 'training.device': \"cuda\" but no CUDA device is usable (CPU-only "
        "LibTorch or no GPU); use training.device = \"cpu\" or \"auto\"");
  if (!cuda) return c10::Device(c10::kCPU);
  // One GPU per local rank (ranks beyond the GPU count share them round-robin).
  const auto gpus = static_cast<int>(at::getNumGPUs());
  const c10::Device d(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank % std::max(1, gpus)));
  c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(d);  // kernels launch on it
  return d;
}

namespace {

using Clock = std::chrono::steady_clock;

// SIGTERM / SIGINT ask for a clean stop: the ranks agree on it at the next step (the flag rides
// in the stats all-gather), save a checkpoint and exit 128 + signal. A second signal kills.
std::atomic<int> g_stop_signal{0};

extern "C" void on_stop_signal(int sig) { g_stop_signal.store(sig); }

class StopSignals {
 public:
  StopSignals() {
    g_stop_signal.store(0);
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sa.sa_flags = SA_RESTART | SA_RESETHAND;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGTERM, &sa, &old_term_);
    ::sigaction(SIGINT, &sa, &old_int_);
  }
  ~StopSignals() {
    ::sigaction(SIGTERM, &old_term_, nullptr);
    ::sigaction(SIGINT, &old_int_, nullptr);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

 private:
  struct sigaction old_term_ {}, old_int_ {};
};

// The first rank not in `bad` (there is one: the majority).
size_t agreeing_rank(const std::vector<int>& bad) {
  size_t r = 0;
  while (std::find(bad.begin(), bad.end(), static_cast<int>(r)) != bad.end()) ++r;
  return r;
}

// CRC32s of this rank's parameters and optimizer state, all-gathered: the ranks that differ
// from the majority (empty when all agree). `crcs` gets every rank's pair.
std::vector<int> diverging_ranks(const std::vector<NamedTensor>& params,
                                 const std::vector<NamedTensor>& opt_state, Comm* comm,
                                 std::vector<std::pair<std::string, std::string>>& crcs) {
  // A CRC32 is exact in a double.
  const auto all = all_gather_values(comm, {static_cast<double>(tensors_crc32_value(params)),
                                            static_cast<double>(tensors_crc32_value(opt_state))});
  std::map<std::vector<double>, int> votes;
  for (const auto& q : all) {
    votes[q] += 1;
    crcs.emplace_back(fmt::format("{:08x}", static_cast<uint32_t>(q[0])),
                      fmt::format("{:08x}", static_cast<uint32_t>(q[1])));
  }
  auto majority = votes.begin();
  for (auto it = votes.begin(); it != votes.end(); ++it)
    if (it->second > majority->second) majority = it;  // ties: the smaller CRC pair, everywhere
  std::vector<int> out_ranks;
  for (size_t r = 0; r < all.size(); ++r)
    if (all[r] != majority->first) out_ranks.push_back(static_cast<int>(r));
  return out_ranks;
}

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

// A norm as users read it: NaN when any element is nonfinite (the check's sum of squares
// covers the finite elements only; events report that part as "finite_norm").
double norm_of(double nonfinite, double sumsq) {
  return nonfinite > 0 ? std::numeric_limits<double>::quiet_NaN() : std::sqrt(sumsq);
}

// The parameters a diagnostics event names: most nonfinite elements first, then the largest
// norms, at most `k`.
nlohmann::json top_params(const std::vector<NamedTensor>& grads, const GradCheckStats& s,
                          int64_t k) {
  std::vector<size_t> idx(s.tensor_nonfinite.size());
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = i;
  auto norm_key = [&](size_t i) {
    return std::isfinite(s.tensor_sumsq[i]) ? s.tensor_sumsq[i] : -1.0;
  };
  std::stable_sort(idx.begin(), idx.end(), [&](size_t a, size_t b) {
    if (s.tensor_nonfinite[a] != s.tensor_nonfinite[b])
      return s.tensor_nonfinite[a] > s.tensor_nonfinite[b];
    return norm_key(a) > norm_key(b);
  });
  nlohmann::json out = nlohmann::json::array();
  for (size_t j = 0; j < idx.size() && static_cast<int64_t>(j) < k; ++j)
    out.push_back({{"name", grads[idx[j]].name},
                   {"nonfinite", static_cast<int64_t>(s.tensor_nonfinite[idx[j]])},
                   {"norm", json_number(norm_of(s.tensor_nonfinite[idx[j]], s.tensor_sumsq[idx[j]]))},
                   {"finite_norm", json_number(std::sqrt(s.tensor_sumsq[idx[j]]))}});
  return out;
}

// The one collective of the decision: every rank's 64-byte stats, in rank order.
std::vector<RankStats> gather_stats(const RankStats& mine, Comm* comm) {
  std::vector<double> values(kRankStatsDoubles);
  std::memcpy(values.data(), &mine, sizeof mine);
  const auto all = all_gather_values(comm, values);
  std::vector<RankStats> out(all.size());
  for (size_t r = 0; r < all.size(); ++r)
    std::memcpy(static_cast<void*>(&out[r]), all[r].data(), sizeof mine);
  return out;
}

// Per rank: the sample ids of its batch and their losses. Gathered on anomalous steps only
// (the decision is the same everywhere, so every rank takes part).
struct SampleTable {
  std::vector<std::vector<int64_t>> ids;
  std::vector<std::vector<double>> losses;
};

SampleTable gather_samples(const std::vector<int64_t>& ids, const std::vector<double>& losses,
                           Comm* comm) {
  const size_t n = ids.size();
  std::vector<double> mine(ids.begin(), ids.end());  // exact below 2^53
  mine.insert(mine.end(), losses.begin(), losses.end());
  SampleTable t;
  for (const auto& q : all_gather_values(comm, mine)) {
    t.ids.emplace_back(q.begin(), q.begin() + static_cast<long>(n));
    t.losses.emplace_back(q.begin() + static_cast<long>(n), q.end());
  }
  return t;
}

// The samples to blame: those of the culprit ranks whose loss is nonfinite, else all of the
// culprit ranks' batches.
std::vector<int64_t> suspect_samples(const Verdict& v, const SampleTable& t) {
  std::vector<int64_t> bad, all;
  for (int r : v.culprit_ranks)
    for (size_t i = 0; i < t.ids[r].size(); ++i) {
      all.push_back(t.ids[r][i]);
      if (!std::isfinite(t.losses[r][i])) bad.push_back(t.ids[r][i]);
    }
  return bad.empty() ? all : bad;
}

std::string brief_ids(const std::vector<int64_t>& ids) {
  if (ids.size() <= 8) return fmt::format("[{}]", fmt::join(ids, ", "));
  return fmt::format("[{}, ... {} in all]",
                     fmt::join(std::vector<int64_t>(ids.begin(), ids.begin() + 8), ", "),
                     ids.size());
}

std::string culprits_text(const Verdict& v) {
  if (v.culprit_ranks.empty()) return "culprit rank unknown";
  return fmt::format("culprit rank{} {}", v.culprit_ranks.size() > 1 ? "s" : "",
                     fmt::join(v.culprit_ranks, ", "));
}

}  // namespace

static TrainResult train_run(const Config& cfg);

TrainResult train(const Config& cfg) {
  try {
    return train_run(cfg);
  } catch (const std::exception& e) {  // the rank's log file says how the run ended, too
    log::write_file_only(log::Level::kError, e.what());
    throw;
  }
}

static TrainResult train_run(const Config& cfg) {
  const TrainingConfig& tc = cfg.training;
  const RankInfo ranks = discover_ranks();
  const bool lead = ranks.rank == 0;  // writes config, metrics, checkpoints; prints progress
  const std::string run_dir = cfg.job.dump_folder;
  fs::make_dirs(run_dir + "/logs");
  log::init(ranks.rank, fmt::format("{}/logs/rank{}.log", run_dir, ranks.rank), log::Level::kInfo,
            lead ? log::Level::kInfo : log::Level::kWarn);
  const c10::Device device = resolve_device(tc.device, ranks.local_rank);
  std::unique_ptr<Comm> comm;
  if (ranks.world_size > 1) {
    // auto: NCCL between GPUs, Gloo between CPUs.
    std::string backend = cfg.parallelism.backend;
    if (backend == "auto") backend = device.is_cuda() && nccl_available() ? "nccl" : "gloo";
    if (backend == "nccl" && !device.is_cuda())
      throw ConfigError("invalid value for 'parallelism.backend': \"nccl\" moves GPU memory but "
                        "training.device is the CPU; use \"gloo\" or \"mpi\" on CPUs");
    CommOptions copt{backend, device.is_cuda() ? device.index() : 0,
                     cfg.comm.init_timeout_seconds, cfg.comm.train_timeout_seconds,
                     cfg.comm.store_listen_address};
    if (copt.backend == "mpi") {
#if LOCKSTEP_WITH_MPI
      comm = make_mpi_comm(ranks, copt);
#else
      throw ConfigError(
          "invalid value for 'parallelism.backend': \"mpi\" but this build has no MPI "
          "(LOCKSTEP_MPI=OFF); install libopenmpi-dev and rebuild, or use \"gloo\"");
#endif
    } else {
      comm = make_comm(ranks, copt);
    }
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
  if (!cfg.data.exclude_ids_file.empty()) {
    auto excluded = read_id_file(cfg.data.exclude_ids_file);
    sampler.set_excluded(excluded, cfg.data.exclude_ids_file);
    log::info("data: {} sample ids excluded by {}", excluded.size(), cfg.data.exclude_ids_file);
  }
  const FaultPlan faults(cfg.fault, ranks.world_size);

  // Model and optimizer
  Gpt model(cfg.model, static_cast<uint64_t>(tc.seed), device);
  // Gradients live in one flat buffer (one all-reduce, or one reduce-scatter when sharded);
  // this rank checks its 1/W block, the one it owns in the sharded mode.
  DataParallel dp(model.parameters(), comm.get(), cfg.parallelism.mode == "sharded",
                  static_cast<int64_t>(cfg.parallelism.bucket_mb * 1048576.0));
  GradCheck check(dp.grads(), dp.shard_offset(), dp.shard_length());
  // [A] this rank's own gradient before the sync: names the culprit rank and parameters.
  std::unique_ptr<GradCheck> local_check;
  if (cfg.diagnostics.local_check) local_check = std::make_unique<GradCheck>(dp.grads());
  SkipDetector detector(cfg.skip);
  AdamW optimizer = AdamW::over(dp.optimizer_params(),
                                {cfg.optimizer.beta1, cfg.optimizer.beta2, cfg.optimizer.eps,
                                 cfg.optimizer.weight_decay,
                                 cfg.optimizer.implementation == "fused"});
  // What a checkpoint holds of the optimizer: all of it (ddp) or this rank's block (sharded,
  // whose AdamW step count equals the optimizer steps taken: a skip advances neither).
  at::Tensor shard_steps = at::zeros({}, at::kFloat);
  auto optimizer_state = [&](int64_t optimizer_steps) -> OptimizerState {
    if (!dp.sharded()) return {optimizer.state()};
    shard_steps.fill_(static_cast<double>(optimizer_steps));
    return {{{"exp_avg", dp.exp_avg_block()},
             {"exp_avg_sq", dp.exp_avg_sq_block()},
             {"step", shard_steps}},
            true,
            dp.shard_offset(),
            dp.shard_length()};
  };
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
      state = ckpt.load(want, model.parameters(), optimizer_state(0), config_json);
      if (dp.sharded()) optimizer.set_step_count(shard_steps.item<float>());
      sampler.set_position(state.data_position);
      if (!state.detector.empty()) detector.load_state(state.detector);
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
  dp.gather_parameters(/*from_params=*/true);  // sharded: the master block from the parameters
  log::info("resident memory after setup {:.0f} MiB (peak {:.0f} MiB)", resident_mib(),
            peak_resident_mib());
  log::info("optimizer AdamW ({}), {} data parallel{}, {} steps, global batch {} x {} x {} ranks "
            "x {} tokens, run dir {}",
            optimizer.fused() ? "fused" : "for-loop", dp.sharded() ? "sharded" : "ddp",
            dp.sharded() ? fmt::format(" (this rank owns {} of {} parameters)",
                                       dp.shard_length(), dp.total())
                         : "",
            tc.steps, tc.local_batch_size,
            tc.gradient_accumulation_steps, ranks.world_size, tc.seq_len, run_dir);

  MetricsWriter metrics(lead ? run_dir + "/metrics.jsonl" : "");
  fs::make_dirs(run_dir + "/diagnostics");
  MetricsWriter events(fmt::format("{}/diagnostics/rank{}.jsonl", run_dir, ranks.rank));
  if (cfg.skip.enabled)
    log::info("skip: on (max_grad_norm {}, grad_norm_zscore {}, loss_zscore {}, window {}, "
              "min_history {}; guards max_consecutive {}, max_fraction {} of {}); lr on skip: {}",
              cfg.skip.max_grad_norm, cfg.skip.grad_norm_zscore, cfg.skip.loss_zscore,
              cfg.skip.window, cfg.skip.min_history, cfg.skip.max_consecutive,
              cfg.skip.max_fraction, cfg.skip.fraction_window, cfg.lr_scheduler.on_skip);
  if (!faults.empty()) log::warn("fault injection is on ([fault]): this run is a test or demo");
  TrainResult result;
  result.start_step = state.step;
  const int64_t tokens_per_step =
      tc.local_batch_size * tc.seq_len * tc.gradient_accumulation_steps * ranks.world_size;
  const auto run_start = Clock::now();
  auto interval_start = run_start;
  int64_t interval_steps = 0;
  double interval_decision_s = 0;

  state.world_size = ranks.world_size;
  auto save = [&] {  // every rank takes part: it writes its shard, or waits for rank 0
    if (!cfg.checkpoint.enable) return;
    auto dir = ckpt.save(state, model.parameters(), optimizer_state(state.optimizer_steps),
                         config_json, comm.get());
    log::info("checkpoint saved: {}", dir);
  };

  const double kNaN = std::numeric_limits<double>::quiet_NaN();
  const bool hold_lr = cfg.lr_scheduler.on_skip == "hold";
  StopSignals stop_signals;
  int64_t last_verified = state.step;  // diagnostics.verify_every: the last step all ranks agreed
  while (state.step < tc.steps) {
    const int64_t step_no = state.step + 1;  // 1-based, as logged
    const double lr = lr_at(schedule, hold_lr ? state.optimizer_steps : state.step);
    const std::string fault = faults.at(step_no, ranks.rank);
    if (fault == "crash" && ranks.restart_count == 0) {  // a machine failure, for restart tests
      log::warn("step {}: fault injection: rank {} kills itself (SIGKILL)", step_no, ranks.rank);
      log::flush();
      std::raise(SIGKILL);
    }

    // Forward and backward over the micro-batches; gradients accumulate in .grad. Faults act
    // where bad data would: on the per-sample losses and on the loss back-propagated.
    double loss_sum = 0;
    std::vector<int64_t> step_ids;
    std::vector<double> step_losses;
    for (int64_t micro = 0; micro < tc.gradient_accumulation_steps; ++micro) {
      auto ids = sampler.next_ids();
      at::Tensor batch = batch_tensor(sampler, ids, tc.seq_len, device);  // (B, T + 1)
      at::Tensor x = batch.slice(1, 0, tc.seq_len);                       // (B, T)
      at::Tensor y = batch.slice(1, 1, tc.seq_len + 1);                   // (B, T)
      at::Tensor per_sample = Gpt::sample_losses(model.forward(x, /*train=*/true), y);  // (B)
      const bool first = micro == 0;
      if (faults.has_poison() || (first && (fault == "nan_loss" || fault == "spike"))) {
        at::Tensor factor = at::ones({static_cast<int64_t>(ids.size())}, at::kFloat);
        float* f = factor.data_ptr<float>();
        for (size_t i = 0; i < ids.size(); ++i)
          if (faults.poisoned(ids[i])) f[i] = std::numeric_limits<float>::quiet_NaN();
        if (first && fault == "nan_loss") f[0] = std::numeric_limits<float>::quiet_NaN();
        if (first && fault == "spike")
          for (size_t i = 0; i < ids.size(); ++i) f[i] *= static_cast<float>(faults.spike_factor());
        per_sample = per_sample.mul(factor.to(device));
      }
      at::Tensor loss = per_sample.mean();
      at::Tensor objective = loss.div(static_cast<double>(tc.gradient_accumulation_steps));
      if (first && fault == "nan_grad") objective = objective.mul(kNaN);
      if (first && fault == "inf_grad")
        objective = objective.mul(std::numeric_limits<double>::infinity());
      objective.backward();
      at::Tensor host = per_sample.detach().to(at::kDouble).cpu();
      step_losses.insert(step_losses.end(), host.data_ptr<double>(),
                         host.data_ptr<double>() + host.numel());
      step_ids.insert(step_ids.end(), ids.begin(), ids.end());
      loss_sum += loss.item<double>();
    }

    // [A] this rank's own gradient, [B] after the sync the slice this rank checks, then the
    // one small collective: every rank holds every rank's 64-byte stats and decides alike.
    const auto check_start = Clock::now();
    RankStats mine;
    GradCheckStats local;
    if (local_check) {
      local = GradCheck::read(local_check->run());
      mine.local_nonfinite = local.nonfinite;
      mine.local_sumsq = local.sumsq;
    }
    const auto sync_start = Clock::now();
    dp.sync_gradients();  // one all-reduce (ddp) or reduce-scatter (sharded) of the flat buffer
    const auto sync_end = Clock::now();
    const GradCheckStats shard = GradCheck::read(check.run());
    mine.shard_nonfinite = shard.nonfinite;
    mine.shard_sumsq = shard.sumsq;
    mine.overflow_runs = shard.overflow_runs;
    mine.loss = loss_sum / static_cast<double>(tc.gradient_accumulation_steps);
    mine.stop_requested = g_stop_signal.load() != 0 ? 1.0 : 0.0;
    for (double l : step_losses) mine.bad_samples += !std::isfinite(l);
    const std::vector<RankStats> all_ranks = gather_stats(mine, comm.get());
    const Verdict verdict = detector.decide(all_ranks);
    // The decision's own cost (checks, stats all-gather, decide), the gradient sync excluded.
    interval_decision_s += std::chrono::duration<double>(sync_start - check_start).count() +
                           std::chrono::duration<double>(Clock::now() - sync_end).count();
    const double loss = verdict.loss;
    const double grad_norm = verdict.grad_norm;
    if (verdict.overflow_runs > 0 && verdict.nonfinite == 0)
      log::warn("step {}: gradient squares overflow fp32 (grad_norm {:.4g}); summed in fp64",
                step_no, grad_norm);

    if (verdict.anomalous()) {
      // Explain it: every rank writes its event (its own view plus the agreed table).
      const SampleTable samples = gather_samples(step_ids, step_losses, comm.get());
      const std::vector<int64_t> suspects = suspect_samples(verdict, samples);
      const GradCheckStats& attribution = local_check ? local : shard;
      nlohmann::json table = nlohmann::json::array();
      for (size_t r = 0; r < all_ranks.size(); ++r)
        table.push_back({{"rank", r},
                         {"loss", json_number(all_ranks[r].loss)},
                         {"local_grad_norm", json_number(norm_of(all_ranks[r].local_nonfinite,
                                                                 all_ranks[r].local_sumsq))},
                         {"local_nonfinite", static_cast<int64_t>(all_ranks[r].local_nonfinite)},
                         {"shard_nonfinite", static_cast<int64_t>(all_ranks[r].shard_nonfinite)},
                         {"bad_samples", static_cast<int64_t>(all_ranks[r].bad_samples)}});
      nlohmann::json loss_list = nlohmann::json::array();
      for (double l : step_losses) loss_list.push_back(json_number(l));
      const bool skip = verdict.decision == Decision::kSkip;
      events.write(
          {{"step", step_no},
           {"decision", decision_name(verdict.decision)},
           {"reasons", verdict.reasons},
           {"guard", verdict.guard},
           {"global",
            {{"grad_norm", json_number(grad_norm)},
             {"nonfinite", static_cast<int64_t>(verdict.nonfinite)},
             {"loss", json_number(loss)},
             {"overflow_runs", static_cast<int64_t>(verdict.overflow_runs)},
             {"grad_norm_z", json_number(verdict.grad_norm_z)},
             {"loss_z", json_number(verdict.loss_z)}}},
           {"window",
            {{"history", detector.history()},
             {"grad_norm_mean", json_number(detector.grad_norms().mean())},
             {"grad_norm_std", json_number(detector.grad_norms().stddev())},
             {"loss_mean", json_number(detector.losses().mean())},
             {"loss_std", json_number(detector.losses().stddev())}}},
           {"thresholds",
            {{"max_grad_norm", cfg.skip.max_grad_norm},
             {"grad_norm_zscore", cfg.skip.grad_norm_zscore},
             {"loss_zscore", cfg.skip.loss_zscore},
             {"min_history", cfg.skip.min_history}}},
           {"rank", ranks.rank},
           {"local",
            {{"loss", json_number(mine.loss)},
             {"grad_norm", json_number(local_check ? norm_of(local.nonfinite, local.sumsq) : kNaN)},
             {"finite_norm", json_number(local_check ? std::sqrt(local.sumsq) : kNaN)},
             {"nonfinite", static_cast<int64_t>(local.nonfinite)},
             {"fault", fault},
             {"sample_ids", step_ids},
             {"sample_losses", loss_list},
             {"top_params_scope", local_check ? "local" : "shard"},
             {"top_params", top_params(dp.grads(), attribution, cfg.diagnostics.top_params)}}},
           {"ranks", table},
           {"culprit_ranks", verdict.culprit_ranks},
           {"suspect_sample_ids", suspects},
           {"lr", lr},
           {"counters",
            {{"step", step_no},
             {"optimizer_steps", state.optimizer_steps},
             {"skipped_steps", state.skipped_steps + (skip ? 1 : 0)},
             {"consecutive_skips", detector.consecutive_skips() + (skip ? 1 : 0)}}}});
      const std::string why = fmt::format("{}", fmt::join(verdict.reasons, ", "));
      if (skip) {
        const std::string msg = fmt::format(
            "step {}: SKIP ({}) | grad_norm {:.4g}, {} nonfinite, loss {:.4g} | {} | samples {} | "
            "weights and optimizer state untouched; skipped {} of {}",
            step_no, why, grad_norm, static_cast<int64_t>(verdict.nonfinite), loss,
            culprits_text(verdict), brief_ids(suspects), state.skipped_steps + 1, step_no);
        if (lead) log::warn("{}", msg); else log::info("{}", msg);
      } else {
        log::flush();
        // The weights are still the last good state: keep it, then stop every rank alike.
        std::string saved = "no checkpoint (checkpoint.enable = false)";
        if (cfg.checkpoint.enable && state.step > 0) {
          save();
          saved = "last good state saved in " + ckpt.dir_of(state.step);
        }
        throw TrainingAborted(fmt::format(
            "step {}: aborted on {} ({}) | grad_norm {:.4g}, {} nonfinite, loss {:.4g} | {} | "
            "samples {} | {}; details in {}/diagnostics; exclude the samples with `lockstep diag "
            "{}` and data.exclude_ids_file, or enable skip.enabled",
            step_no, why, verdict.guard, grad_norm, static_cast<int64_t>(verdict.nonfinite),
            loss, culprits_text(verdict), brief_ids(suspects), saved, run_dir, run_dir));
      }
    }

    // The update. A skip reaches the fused AdamW as found_inf = 1: parameters, moments and step
    // counts stay bitwise as they were. Clipping reuses the agreed norm through grad_scale.
    const bool skipped = verdict.decision == Decision::kSkip;
    at::Tensor grad_scale, found_inf;
    const auto options = model.parameters()[0].tensor.options();
    const double clip = skipped ? 1.0 : clip_coefficient(grad_norm, tc.max_norm);
    if (skipped) found_inf = at::ones({}, options);
    if (clip < 1.0) grad_scale = at::empty({}, options).fill_(1.0 / clip);
    optimizer.step(lr, grad_scale, found_inf);
    if (!skipped) dp.gather_parameters();  // sharded: every rank's updated block to all ranks
    dp.zero_grad();
    detector.record(verdict);
    if (fault == "desync") {  // a silent divergence, for the verify_every tests
      at::Tensor w = model.parameters()[0].tensor.detach();
      w.view({-1}).narrow(0, 0, 1).add_(1e-3);
    }

    state.step += 1;
    state.optimizer_steps += skipped ? 0 : 1;
    state.skipped_steps += skipped ? 1 : 0;
    state.data_position = sampler.position();
    state.tokens_seen += tokens_per_step;
    state.detector = detector.state();
    result.losses.push_back(loss);
    ++interval_steps;

    const bool last = state.step == tc.steps;
    if (state.step % cfg.metrics.log_freq == 0 || last) {
      const auto now = Clock::now();
      const double secs = std::chrono::duration<double>(now - interval_start).count();
      const double ms_per_step = 1e3 * secs / static_cast<double>(interval_steps);
      const double tok_s = static_cast<double>(interval_steps * tokens_per_step) / secs;
      const double eta = static_cast<double>(tc.steps - state.step) * ms_per_step / 1e3;
      log::info("step {:>6}/{} | loss {:.4f} | grad_norm {:.4f} | lr {:.3e} | skipped {} | "
                "ms/step {:.1f} | tok/s {:.0f} | ETA {}",
                state.step, tc.steps, loss, grad_norm, lr, state.skipped_steps, ms_per_step,
                tok_s, format_eta(eta));
      metrics.write({{"step", state.step},
                     {"loss", json_number(loss)},
                     {"grad_norm", json_number(grad_norm)},
                     {"clip_coef", clip},
                     {"lr", lr},
                     {"decision", decision_name(verdict.decision)},
                     {"ms_per_step", ms_per_step},
                     {"decision_ms", 1e3 * interval_decision_s /
                                         static_cast<double>(interval_steps)},
                     {"tokens_per_s", tok_s},
                     {"tokens_seen", state.tokens_seen},
                     {"optimizer_steps", state.optimizer_steps},
                     {"skipped_steps", state.skipped_steps},
                     {"consecutive_skips", detector.consecutive_skips()},
                     {"skip_rate", static_cast<double>(state.skipped_steps) /
                                       static_cast<double>(state.step)},
                     {"window_history", detector.history()},
                     {"grad_norm_mean", json_number(detector.grad_norms().mean())},
                     {"grad_norm_std", json_number(detector.grad_norms().stddev())},
                     {"loss_mean", json_number(detector.losses().mean())},
                     {"loss_std", json_number(detector.losses().stddev())},
                     {"rss_mib", resident_mib()},
                     {"elapsed_s", std::chrono::duration<double>(now - run_start).count()}});
      interval_start = now;
      interval_steps = 0;
      interval_decision_s = 0;
    }
    const bool verify = comm && cfg.diagnostics.verify_every > 0 &&
                        (state.step % cfg.diagnostics.verify_every == 0 || last);
    if (verify) {
      std::vector<std::pair<std::string, std::string>> crcs;
      // Sharded ranks hold different optimizer blocks by design: parameters only.
      const auto bad = diverging_ranks(model.parameters(),
                                       dp.sharded() ? std::vector<NamedTensor>{} : optimizer.state(),
                                       comm.get(), crcs);
      if (!bad.empty()) {
        nlohmann::json table = nlohmann::json::array();
        for (size_t r = 0; r < crcs.size(); ++r)
          table.push_back({{"rank", r}, {"params_crc32", crcs[r].first},
                           {"optimizer_crc32", crcs[r].second}});
        events.write({{"step", state.step},
                      {"decision", "abort"},
                      {"reasons", {"desync"}},
                      {"guard", "diagnostics.verify_every"},
                      {"global", nlohmann::json::object()},
                      {"rank", ranks.rank},
                      {"local", {{"fault", fault}}},
                      {"ranks", table},
                      {"culprit_ranks", bad},
                      {"suspect_sample_ids", nlohmann::json::array()}});
        log::flush();
        throw TrainingAborted(fmt::format(
            "step {}: desync: rank(s) {} hold other parameters or optimizer state than the "
            "majority (params crc32 {} vs {}); the ranks no longer train one model, so the job "
            "stops without saving; the last step verified consistent is {}: resume from a "
            "checkpoint at or before it, and look for nondeterminism or memory errors on those "
            "ranks",
            state.step, fmt::join(bad, ", "), crcs[bad[0]].first, crcs[agreeing_rank(bad)].first,
            last_verified));
      }
      last_verified = state.step;
    }
    const bool saved = cfg.checkpoint.enable && (state.step % cfg.checkpoint.interval == 0 || last);
    if (saved) save();
    if (verdict.stop && !last) {
      // Every rank saw the same request in the same all-gather: all stop after this step.
      if (!saved) save();  // a no-op with checkpoint.enable = false
      const int signal_seen = g_stop_signal.load();
      const int sig = signal_seen ? signal_seen : SIGTERM;  // asked by another rank
      log::flush();
      throw Error(static_cast<ExitCode>(128 + sig),
                  fmt::format("stopped by {} after step {} of {}{}; run the same command again to "
                              "resume",
                              sig == SIGINT ? "SIGINT" : "SIGTERM", state.step, tc.steps,
                              cfg.checkpoint.enable
                                  ? "; checkpoint saved in " + ckpt.dir_of(state.step)
                                  : " (checkpoint.enable = false: nothing saved)"));
    }
  }

  const double total = std::chrono::duration<double>(Clock::now() - run_start).count();
  const int64_t ran = state.step - result.start_step;
  result.final_step = state.step;
  result.optimizer_steps = state.optimizer_steps;
  result.skipped_steps = state.skipped_steps;
  result.tokens_per_second = ran > 0 ? static_cast<double>(ran * tokens_per_step) / total : 0.0;
  if (ran > 0)
    log::info("done: {} steps in {:.1f} s, {:.0f} tok/s, final loss {:.4f}, {} skipped, peak "
              "resident memory {:.0f} MiB, parameters crc32 {}",
              ran, total, result.tokens_per_second, result.losses.back(), state.skipped_steps,
              peak_resident_mib(), tensors_crc32(model.parameters()));
  else
    log::info("nothing to do: the run is already at step {} of {}", state.step, tc.steps);
  log::flush();
  return result;
}

}  // namespace lockstep
