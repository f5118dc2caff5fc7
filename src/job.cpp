#include "job.h"

#include <ATen/Parallel.h>
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <set>
#include <thread>

#include "clock.h"
#include "compute.h"
#include "decide/record.h"
#include "export/hf.h"
#include "fsutil.h"
#include "lockstep/error.h"
#include "rundir.h"
#include "log.h"
#include "diag/metrics.h"
#include "runtime.h"
#include "text.h"

namespace lockstep {
namespace {

// The console: rank 0 prints info, the others warnings only; no rank in the pattern when
// lockstep-run prefixes it, no colours under mpirun (its pseudo-terminals are not the user's)
// or with NO_COLOR. The rank's log file opens once the run is known to start (accept()).
void start_logging(Job& j) {
  const char* no_color = std::getenv("NO_COLOR");
  log::init(j.ranks.rank,
            {j.lead ? log::Level::kInfo : log::Level::kWarn, !j.ranks.output_prefixed,
             j.ranks.launcher != "mpi" && !(no_color && *no_color)});
}

// The run folder is this run's now: its log files, config.toml and diagnostics file.
void accept(Job& j) {
  fs::make_dirs(j.run_dir + "/logs");
  log::attach_file(fmt::format("{}/logs/rank{}.log", j.run_dir, j.ranks.rank));
  if (j.lead) fs::write_file_atomic(j.run_dir + "/config.toml", to_toml(j.config));
  fs::make_dirs(j.run_dir + "/diagnostics");
  j.judge->open_events(fmt::format("{}/diagnostics/rank{}.jsonl", j.run_dir, j.ranks.rank),
                       [](const std::string& w) { log::warn("{}", w); }, true);
}

void connect_ranks(Job& j) {
  if (j.ranks.world_size == 1) return;
  j.comm = connect(j.ranks, j.config.parallelism.backend, j.device, j.config.comm);
  log::info("rank {} of {} ({}), {} collectives, rendezvous {}:{}", j.ranks.rank,
            j.ranks.world_size, j.ranks.launcher, j.comm->backend(), j.ranks.master_addr,
            j.ranks.master_port);
}

// Where the exclude list comes from, for messages: the file alone on a fresh start.
std::string exclusion_origin(const DataConfig& d, bool carried) {
  if (!carried && d.readmit_ids_file.empty()) return d.exclude_ids_file;
  std::string out = carried ? "the resumed checkpoint's exclude list" : "";
  if (!d.exclude_ids_file.empty())
    out += (out.empty() ? "" : " + ") + d.exclude_ids_file;
  if (!d.readmit_ids_file.empty()) out += " - " + d.readmit_ids_file;
  return out;
}

// The sample ids never drawn: those the resumed checkpoint carries (`carried`; none on a fresh
// start), with data.exclude_ids_file's, less data.readmit_ids_file's. A quarantine stays in
// force across resumes until readmitted. Sets the sampler and the fingerprint's ids.
void exclude_samples(Job& j, const std::vector<int64_t>& carried) {
  const DataConfig& d = j.config.data;
  std::set<int64_t> ids(carried.begin(), carried.end());
  if (!d.exclude_ids_file.empty())
    for (int64_t id : read_id_file(d.exclude_ids_file)) ids.insert(id);
  if (!d.readmit_ids_file.empty())
    for (int64_t id : read_id_file(d.readmit_ids_file, "data.readmit_ids_file")) ids.erase(id);
  std::vector<int64_t> now(ids.begin(), ids.end());
  if (!now.empty() || !j.excluded.empty())
    j.sampler->set_excluded(now, exclusion_origin(d, !carried.empty()));
  j.excluded = std::move(now);
  set_excluded_ids(j.fingerprint, j.excluded);
}

// "data: 3 files digested (1.2 GiB read in 0.8 s, 2 from the digest cache)"
void log_digests(const std::string& what, const DigestReads& reads, double seconds) {
  if (reads.read + reads.cached == 0) return;
  log::info("{}: {} file{} digested ({} read in {:.1f} s, {} from the digest cache)", what,
            reads.read + reads.cached, reads.read + reads.cached > 1 ? "s" : "",
            bytes_text(static_cast<double>(reads.bytes)), seconds, reads.cached);
  if (reads.distrusted > 0)
    log::warn("{}: {} digest cache entr{} did not carry this user's key (edited, damaged or "
              "another user's): {} read again; the cache folder is $LOCKSTEP_DIGEST_CACHE, else "
              "~/.cache/lockstep/digests",
              what, reads.distrusted, reads.distrusted > 1 ? "ies" : "y",
              reads.distrusted > 1 ? "those files were" : "that file was");
}

void open_data(Job& j) {
  const DataConfig& d = j.config.data;
  const TrainingConfig& t = j.config.training;
  j.source = open_training_data(j.config);
  for (const std::string& w : j.source->warnings()) log::warn_shared("{}", w);
  j.sampler = std::make_unique<Sampler>(
      *j.source, SamplerOptions{t.seq_len, t.local_batch_size, j.ranks.rank, j.ranks.world_size,
                                static_cast<uint64_t>(t.seed)});
  j.validator = make_validator(j.config, j.ranks, j.device);
  exclude_samples(j, {});
  const auto start = Clock::now();
  DigestReads reads;
  j.fingerprint = job_fingerprint(
      j.config,
      {*j.source, j.validator ? &j.validator->source() : nullptr, j.excluded,
       j.device.is_cuda() ? device_name(j.device) : ""},
      reads);
  log_digests("data", reads, seconds_since(start));
  if (!j.excluded.empty())
    log::info("data: {} sample ids excluded by {}", j.excluded.size(), exclusion_origin(d, false));
}

// checkpoint.initial_load_path: a fresh run starts from a Hugging Face folder's weights, read
// into the model before the data-parallel mode takes its copies (fsdp: into each unit as the
// model is drawn, before it is sharded); a resume of the run's own checkpoint does not read it.
// Returns the folder to read ("" for none), checked against the run's [model].
std::string initial_weights(const Job& j) {
  const Config& c = j.config;
  const std::string& path = c.checkpoint.initial_load_path;
  if (path.empty()) return "";
  if (j.resume_step > 0) return "";
  check_same_model(c.model, model_config_from_hf(path), path);
  const auto start = Clock::now();
  DigestReads reads;
  agree_on_job(weights_fingerprint(path, reads), j.comm.get());  // every rank reads the same
  log_digests("initial weights", reads, seconds_since(start));
  return path;
}

// The model: drawn whole, or (fsdp) unit by unit into this rank's shards, never whole; then the
// sink holds the shards for the data-parallel mode.
std::unique_ptr<UnitSink> draw_model(Job& j) {
  const Config& c = j.config;
  const std::string hf = initial_weights(j);
  const auto start = Clock::now();
  std::unique_ptr<UnitSink> sink;
  if (c.parallelism.mode == ParallelMode::kFsdp) {
    std::function<void(const std::vector<NamedTensor>&)> fill;
    if (!hf.empty())
      fill = [hf, model = c.model](const std::vector<NamedTensor>& unit) {
        load_hf_weights(hf, model, unit, /*whole=*/false);
      };
    sink = make_fsdp_sink(j.comm.get(), j.device, dtype_of(c.training.mixed_precision_param), fill);
  }
  j.model = make_model(c.model, static_cast<uint64_t>(c.training.seed), j.device, sink.get());
  if (!hf.empty() && !sink) load_hf_weights(hf, c.model, j.model->parameters());
  if (!hf.empty())
    log::info("initial weights: {} ({} tensors read in {:.1f} s); the optimizer starts fresh",
              hf, j.model->parameters().size(), seconds_since(start));
  return sink;
}

// The model, data parallelism over its parameters (with the optimizer), and the checks:
// [B] reads the 1/W block of the synced gradient this rank owns, [A] this rank's own gradient.
void build_model(Job& j) {
  const Config& c = j.config;
  const std::unique_ptr<UnitSink> sink = draw_model(j);
  // activation_checkpoint: units 1 to n_layers are the blocks (the embeddings, head never)
  std::vector<bool> recompute = recomputed_blocks(c.activation_checkpoint, c.model.n_layers);
  recompute.insert(recompute.begin(), false);
  j.model->units().set_recompute(std::move(recompute));
  j.dp = make_data_parallel(
      j.model->parameters(), j.comm.get(),
      {c.parallelism.mode, static_cast<int64_t>(c.parallelism.bucket_mb * 1048576.0),
       c.parallelism.overlap, adamw_options(c.optimizer),
       dtype_of(c.training.mixed_precision_param), dtype_of(c.training.mixed_precision_reduce),
       c.parallelism.prefetch, c.diagnostics.local_check, &j.model->units(), sink.get()});
  j.shard_check = std::make_unique<GradCheck>(j.dp->synced_grads(), j.dp->shard_offset(),
                                              j.dp->shard_length());
  // [B] per bucket: each bucket's (ddp) or slice's (sharded) blocks are checked as it lands,
  // the rest after the sync.
  j.dp->on_landed([check = j.shard_check.get()](int64_t lo, int64_t hi) {
    check->run_range(lo, hi);
  });
  if (c.diagnostics.local_check && !j.dp->checks_local())
    j.local_check = std::make_unique<GradCheck>(j.dp->grads());
}

// One device's peak FLOP/s for MFU: metrics.peak_tflops, else a known GPU's.
double peak_flops(const Config& c, c10::Device device) {
  if (c.metrics.peak_tflops > 0) return c.metrics.peak_tflops * 1e12;
  if (!device.is_cuda()) return 0;
  const std::string name = device_name(device);
  const double peak =
      known_peak_flops(name, c.training.mixed_precision_param, c.training.allow_tf32);
  if (peak == 0)
    log::info("MFU: no peak FLOP/s known for '{}'; set metrics.peak_tflops to see it", name);
  return peak;
}

void log_setup(const Job& j) {
  const Config& c = j.config;
  const TrainingConfig& t = c.training;
  for (const std::string& note : c.notes) log::info("{}", note);
  if (j.peak_flops > 0)
    log::info("MFU: {:.3g} training FLOPs per token against {:g} TFLOP/s per device",
              j.model->flops_per_token(t.seq_len), j.peak_flops / 1e12);
  if (j.validator) log::info("{}", j.validator->describe());
  const MemoryPlan plan = memory_plan(c, j.ranks.world_size, j.device.is_cuda());
  log::info("memory plan per rank: up to {} ({} of state in {} mode, {} of activations{}{}, {} "
            "of runtime)",
            bytes_text(plan.total()), bytes_text(plan.state), name_of(c.parallelism.mode),
            bytes_text(plan.activations),
            plan.validation > 0 ? fmt::format(", {} in a validation pass",
                                              bytes_text(plan.validation))
                                : "",
            plan.replay > 0 ? fmt::format(", {} kept aside by a replay", bytes_text(plan.replay))
                            : "",
            bytes_text(plan.runtime));
  log::info("optimizer AdamW ({}), {}, {} steps, global batch {} x {} x {} ranks x {} tokens, "
            "run dir {}",
            j.dp->fused_optimizer() ? "fused" : "for-loop", j.dp->describe(), t.steps,
            t.local_batch_size, t.gradient_accumulation_steps, j.ranks.world_size, t.seq_len,
            j.run_dir);
  if (c.activation_checkpoint.mode != ActivationCheckpoint::kNone) {
    std::vector<int64_t> blocks;
    const auto recompute = recomputed_blocks(c.activation_checkpoint, c.model.n_layers);
    for (size_t b = 0; b < recompute.size(); ++b)
      if (recompute[b]) blocks.push_back(static_cast<int64_t>(b));
    log::info("activation checkpointing ({}): blocks [{}] of {} recompute their forward in "
              "backward",
              name_of(c.activation_checkpoint.mode), fmt::join(blocks, ", "), c.model.n_layers);
  }
  if (c.skip.enabled)
    log::info("skip: on (max_grad_norm {}, grad_norm_zscore {}, loss_zscore {}, window {}, "
              "min_history {}; guards max_consecutive {}, max_fraction {} of {}); lr on skip: {}",
              c.skip.max_grad_norm, c.skip.grad_norm_zscore, c.skip.loss_zscore, c.skip.window,
              c.skip.min_history, c.skip.max_consecutive, c.skip.max_fraction,
              c.skip.fraction_window, name_of(c.lr_scheduler.on_skip));
  if (j.plan.on_device)
    log::info("decision: on {}, read by the host a step later (skip.device_decision)",
              j.device.str());
  else if (!j.plan.host_because.empty())
    log::info("decision: on the host, one sync per step ({})", j.plan.host_because);
  if (!j.plan.exchange_line().empty()) log::info("{}", j.plan.exchange_line());
  if (t.mixed_precision_param != Precision::kFloat32 ||
      t.mixed_precision_reduce != ReducePrecision::kFloat32)
    log::info("mixed precision: {} forward and backward, {} gradient reduction, fp32 master "
              "weights and moments; loss scale {}",
              name_of(t.mixed_precision_param), name_of(t.mixed_precision_reduce), t.loss_scale);
  if (t.mixed_precision_param == Precision::kFloat16 && !j.judge->detector().loss_scaling())
    log::warn_shared("training.mixed_precision_param = \"float16\" with training.loss_scale = "
                     "\"none\": small gradients underflow to zero in fp16; set "
                     "training.loss_scale = \"dynamic\"");
  if (!j.faults->empty())
    log::warn_shared("fault injection is on ([fault]): this run is a test or demo");
}

}  // namespace

std::unique_ptr<Job> build_job(const Config& config) {
  auto job = std::make_unique<Job>(config);
  Job& j = *job;
  const Config& c = j.config;
  j.ranks = discover_ranks();
  j.lead = j.ranks.rank == 0;
  j.run_dir = c.job.dump_folder;
  j.startup_signals = std::make_unique<StartupSignals>();
  const std::string log_file = fmt::format("{}/logs/rank{}.log", j.run_dir, j.ranks.rank);
  start_logging(j);
  j.device = resolve_device(c.training.device, j.ranks.local_rank);
  // Everything a rank can check alone is checked before the rendezvous (a bad data file must
  // not cost the others their init timeout); rank 0 claims the run folder.
  open_data(j);
  j.faults = std::make_unique<FaultInjector>(c.fault, j.ranks.rank, j.ranks.world_size,
                                             j.ranks.restart_count);
  if (j.lead) {
    j.lock = std::make_unique<RunFolderLock>(j.run_dir);
    if (!j.lock->previous_holder().empty())
      log::warn("run folder {}: took over the lock of a run that ended without releasing it ({})",
                j.run_dir, j.lock->previous_holder());
    StartupSignals::log_to(log_file);  // the folder is this run's
    MetricsSink::check(c.metrics);        // TensorBoard / W&B writers: before anyone waits
  }
  connect_ranks(j);
  if (j.comm) {  // before any collective whose size the config sets
    const auto start = Clock::now();
    agree_on_job(j.fingerprint, j.comm.get());
    log::info("the {} ranks run the same job (fingerprint {} of {} keys, agreed in {:.1f} ms)",
              j.ranks.world_size, j.fingerprint.digest(), j.fingerprint.items.size(),
              seconds_since(start) * 1e3);
    StartupSignals::log_to(log_file);  // rank 0 holds the folder for this very job
  }
  // Before anything is allocated (the ranks run the same job: they all refuse alike).
  check_memory_plan(c, j.ranks.world_size, j.ranks.local_world_size, j.device);
  const int threads = set_intra_op_threads(c.training.threads, j.ranks.local_world_size);
  if (c.training.threads == 0) {  // only the cores shared out can be oversubscribed
    const int cores = static_cast<int>(std::thread::hardware_concurrency());
    const std::string busy =
        busy_machine_warning(load_average(), cores, j.ranks.local_world_size, threads);
    if (!busy.empty()) log::warn_shared("{}", busy);
  }
  if (j.device.is_cuda()) allow_tf32(c.training.allow_tf32);
  seed_global_rng(static_cast<uint64_t>(c.training.seed));
  const std::string& folder = c.checkpoint.folder;
  j.checkpointer = std::make_unique<Checkpointer>(
      CheckpointOptions{folder.starts_with("/") ? folder : j.run_dir + "/" + folder,
                        c.checkpoint.keep_latest_k, c.checkpoint.timeout_seconds});
  if (c.checkpoint.enable)  // every rank resumes from the same step, or none starts
    j.resume_step = j.checkpointer->agreed_step_to_load(c.checkpoint.load_step, j.comm.get());
  build_model(j);
  j.peak_flops = peak_flops(c, j.device);
  j.tokens_per_step = c.training.local_batch_size * c.training.seq_len *
                      c.training.gradient_accumulation_steps * j.ranks.world_size;
  std::vector<std::string> tensors;  // the per-tensor policies': check [B]'s
  for (const NamedTensor& g : j.dp->synced_grads()) tensors.push_back(g.name);
  j.plan = plan_exchange(c, update_path(c, j.device, j.ranks.local_world_size),
                         j.ranks.world_size);
  j.judge = std::make_unique<StepJudge>(
      c, with_token_guard(c.skip, j.tokens_per_step), j.dp->grads(), std::move(tensors),
      j.comm.get(),
      StepJudge::Where{j.ranks.rank, j.ranks.world_size, hostname(), j.device.str(), "lockstep",
                       j.plan.own_windows()});
  // A replay on the CPU reproduces bit for bit; GPU kernels (atomics in the embedding backward)
  // may sum in another order, so there a replay within 1e-4 (relative) reproduces.
  j.triager = std::make_unique<Triager>(c.skip, c.diagnostics.replay_every, j.comm.get(),
                                        j.ranks.rank, j.device.is_cuda() ? 1e-4 : 0.0);
  j.triager->set_bystander([&j] { bystand(j); });
  j.schedule = schedule_of(c);
  j.compute_clock = std::make_unique<ComputeClock>(j.device);
  j.stragglers = std::make_unique<StragglerWatch>(
      c.diagnostics.straggler_factor, c.diagnostics.straggler_window, j.ranks.world_size);
  j.config_json = nlohmann::json::parse(to_json(c));
  return job;
}

namespace {

// A fresh start: an earlier run's checkpoints in the folder are refused, archived or deleted
// (job.on_existing; rank 0 moves them, every rank refuses alike).
void start_fresh(Job& j) {
  const auto earlier = j.checkpointer->steps();
  if (earlier.empty()) return;
  if (!j.lead && j.config.job.on_existing != OnExisting::kRefuse) return;
  const std::string done = prepare_fresh_start(j.run_dir, j.checkpointer->folder(), earlier,
                                               j.config.job.on_existing);
  log::warn("{}", done);
}

// Loads checkpoint `step`, after checking that resuming from it keeps the data order; a rewind
// (an earlier step than the latest) names the checkpoints it will replace, in the log and in
// the metrics.
void load(Job& j, int64_t step) {
  const nlohmann::json meta = j.checkpointer->meta(step);
  for (const auto& w : check_resume(meta.at("config"), meta.at("world_size").get<int64_t>(),
                                    j.config, j.ranks.world_size))
    log::warn_shared("{}", w);
  const auto carried = meta.value("excluded_ids", nlohmann::json::array());
  exclude_samples(j, carried.get<std::vector<int64_t>>());
  if (!carried.empty())
    log::info("data: {} sample ids excluded by {} (data.readmit_ids_file lets ids go)",
              j.excluded.size(), exclusion_origin(j.config.data, true));
  for (const auto& w : check_same_data(meta.value("fingerprint", nlohmann::json::object()),
                                       j.fingerprint, j.config.checkpoint.allow_data_change))
    log::warn_shared("{}", w);
  const auto start = Clock::now();
  j.state = j.checkpointer->load(step, j.model->parameters(), j.config_json,
                                 [&](CheckpointReader& r) { j.dp->load(r); });
  const double secs = seconds_since(start);
  j.sampler->set_position(j.state.data_position);
  j.judge->load_state(j.state.detector, j.state.loss_scale);
  SkipDetector& detector = j.judge->detector();
  if (j.config.skip.reset_guards_on_resume && detector.consecutive_skips() > 0) {
    log::warn_shared("skip.reset_guards_on_resume: the skip guards count from 0 again ({} skips "
                     "in a row before)",
                     detector.consecutive_skips());
    detector.reset_guards();
  }
  std::vector<int64_t> newer;
  for (int64_t s : j.checkpointer->steps())
    if (s > step) newer.push_back(s);
  log::info("resumed from {} (step {}, data position {}; read in {:.1f} s)",
            j.checkpointer->dir_of(step), j.state.step, j.state.data_position, secs);
  if (!newer.empty())
    log::warn_shared("rewinding to step {}: the newer checkpoints (steps {}) will be replaced as "
                     "the run passes them",
                     step, fmt::join(newer, ", "));
  if (j.lead)
    JsonlWriter(j.run_dir + "/metrics.jsonl")
        .write({{"event", newer.empty() ? "resume" : "rewind"},
                {"step", step},
                {"checkpoint", j.checkpointer->dir_of(step)},
                {"newer_checkpoints", newer}});
}

// A fresh run in a folder whose metrics.jsonl holds an earlier run's records (no checkpoint
// to archive them with): a marker record first, so readers (lockstep report) start after it.
void mark_fresh_start(const Job& j) {
  const std::string path = j.run_dir + "/metrics.jsonl";
  std::error_code ec;
  if (!j.lead || !std::filesystem::exists(path, ec) || std::filesystem::file_size(path, ec) == 0)
    return;
  JsonlWriter(path).write({{"event", "start"},
                           {"step", 0},
                           {"note", "a fresh run starts here; the records above are an earlier "
                                    "run's"}});
  log::warn("{} holds an earlier run's records; this run's follow a \"start\" record", path);
}

}  // namespace

void resume(Job& j) {
  const int64_t step = j.resume_step;
  if (step > 0) {
    load(j, step);
  } else {
    start_fresh(j);
    mark_fresh_start(j);
  }
  j.state.world_size = j.ranks.world_size;
  j.state.fingerprint = j.fingerprint.to_json();
  j.state.excluded_ids = j.excluded;
  log::info("lockstep: model {}, {} parameters, device {}, {} threads, data: {}",
            name_of(j.config.model.name), with_commas(j.model->num_parameters()), j.device.str(),
            at::get_num_threads(), j.source->describe());
  // Every rank starts from rank 0's weights (identical by construction: same seed, same
  // checkpoint; the broadcast makes it so whatever happened). Moving a whole model may take
  // longer than a training collective: it waits as long as a checkpoint's.
  {
    const TimeoutScope timeout(j.comm.get(), j.config.checkpoint.timeout_seconds);
    j.dp->replicate_parameters();
  }
  const double setup_peak = peak_resident_mib();
  return_free_memory();  // what setup freed (the units drawn on the CPU) is not the run's
  log::info("resident memory after setup {:.0f} MiB (peak {:.0f} MiB; the run's own peak counts "
            "from here)",
            resident_mib(), setup_peak);
  reset_peak_resident();
  accept(j);
  log_setup(j);
}

std::string save_checkpoint(Job& j) {
  if (!j.config.checkpoint.enable) return "";
  j.state.detector = record_state(*j.judge, j.comm.get());  // every rank's windows
  j.state.loss_scale = j.judge->loss_scale_state();
  const double before = resident_mib();
  const bool peak = reset_peak_resident();
  const auto start = Clock::now();
  const std::string dir =
      j.checkpointer->save(j.state, j.dp->weights(), j.dp->optimizer_part(j.state.optimizer_steps),
                           j.config_json, j.comm.get());
  const double secs = seconds_since(start);
  log::info("checkpoint saved: {} ({:.1f} s{})", dir, secs,
            peak ? fmt::format(", peak resident memory +{:.0f} MiB",
                               std::max(0.0, peak_resident_mib() - before))  // never "+-0"
                 : "");
  return dir;
}

}  // namespace lockstep
