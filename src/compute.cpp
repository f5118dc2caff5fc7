#include "compute.h"

#include <ATen/Context.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>

#include "checkpoint/safetensors.h"
#include "comm/comm.h"
#include "data/batch.h"
#include "runtime.h"
#include "splitmix.h"

namespace lockstep {
namespace {

// Where every forward is collective (fsdp gathers with every rank), a rank may not end its batch
// alone: the ranks vote at each micro-batch boundary, one 8-byte sum of their stop flags, and
// stop together. On the host (Gloo, MPI) the vote is read at once (the gathers already keep the
// ranks in step); on a GPU it is read at the next boundary, so the host waits at most for the
// micro-batch before the one it queues, never for the one in flight. Every rank reads the same
// sum at the same boundary.
class StopVote {
 public:
  StopVote(Comm* comm, bool voting) : comm_(voting ? comm : nullptr) {
    lagged_ = comm_ != nullptr && comm_->device().is_cuda();
  }
  StopVote(const StopVote&) = delete;
  StopVote& operator=(const StopVote&) = delete;
  ~StopVote() {
    try {
      if (work_) work_->wait();  // left only when the batch threw: complete it, keep that error
    } catch (...) {
    }
  }
  // At the boundary before micro-batch `micro` (of `last` + 1): whether the ranks stop here.
  bool stop(int64_t micro, int64_t last) {
    if (comm_ == nullptr) return micro > 0 && StopSignals::received() != 0;
    if (!lagged_) {
      if (micro == 0) return false;
      start();
      return read();
    }
    const bool agreed = read();  // the previous boundary's vote
    if (!agreed && micro < last) start();
    return agreed;
  }

 private:
  void start() {
    flag_ = at::full({1}, StopSignals::received() != 0 ? 1.0 : 0.0, at::kDouble);
    work_ = comm_->all_reduce_sum_async(flag_);
  }
  bool read() {
    if (!work_) return false;
    work_->wait();
    work_.reset();
    return flag_.item<double>() > 0;
  }
  Comm* comm_;
  bool lagged_ = false;
  at::Tensor flag_;
  std::unique_ptr<CommWork> work_;
};

// Forward and backward of `ids` as rank `batch_rank`'s batch of `step` (in micro-batches of
// ids.size() / gradient_accumulation_steps, in order). Faults act where bad data would: on the
// per-sample losses and the loss back-propagated; a bad device's on the gradient after it.
void run_batch(Job& job, int64_t step, int batch_rank, int index, const std::vector<int64_t>& ids,
               RankStep& out) {
  const TrainingConfig& t = job.config.training;
  const int64_t micro_batches = t.gradient_accumulation_steps;
  const auto per_micro = static_cast<int64_t>(ids.size()) / micro_batches;
  const double scale = job.judge->detector().loss_scale();
  job.faults->begin_computation(batch_rank, index);
  std::vector<at::Tensor> samples;  // on the device: no host sync on a clean step
  at::Tensor loss_sum;              // fp64, in micro-batch order
  // A stop signal ends this rank's own batch after the micro-batch in flight (the ranks agree
  // on it in the step's exchange: nothing of the step lands, the run stops before it); in fsdp
  // the ranks vote on the boundary first. A replay (index > 0) runs to its end.
  StopVote vote(job.comm.get(), index == 0 && micro_batches > 1 && job.dp->collective_forward());
  for (int64_t micro = 0; micro < micro_batches; ++micro) {
    if (index == 0 && vote.stop(micro, micro_batches - 1)) {
      out.interrupted = true;
      break;
    }
    const std::vector<int64_t> mids(ids.begin() + micro * per_micro,
                                    ids.begin() + (micro + 1) * per_micro);
    if (job.config.model.dropout > 0)  // the same masks wherever this batch is recomputed
      at::manual_seed(splitmix64(static_cast<uint64_t>(job.config.training.seed) ^
                                 splitmix64((static_cast<uint64_t>(step) << 20) ^
                                            (static_cast<uint64_t>(batch_rank) << 8) ^
                                            static_cast<uint64_t>(micro))));
    at::Tensor batch = load_batch(*job.sampler, mids, t.seq_len, job.device);  // (B, T + 1)
    at::Tensor x = batch.slice(1, 0, t.seq_len);                               // (B, T)
    at::Tensor y = batch.slice(1, 1, t.seq_len + 1);                           // (B, T)
    at::Tensor per_sample = sample_losses(job.model->forward(x, /*train=*/true), y);  // (B)
    per_sample = job.faults->on_sample_losses(per_sample, mids, micro);
    at::Tensor loss = per_sample.mean();
    at::Tensor objective =
        job.faults->on_objective(loss.div(static_cast<double>(micro_batches)), micro);
    if (micro == micro_batches - 1 && index == 0) job.dp->begin_last_backward();  // overlap
    // Decided on the device, the scale is the device's (the host's is a step behind).
    const at::Tensor scaled =
        job.judge->on_device() && job.judge->detector().loss_scaling()
            ? objective.mul(job.judge->device_loss_scale().to(objective.scalar_type()))
        : scale == 1.0 ? objective
                       : objective.mul(scale);
    scaled.backward();
    const at::Tensor mean = loss.detach().to(at::kDouble);
    loss_sum = micro == 0 ? mean : loss_sum.add(mean);
    samples.push_back(per_sample.detach());
  }
  job.faults->on_gradients(job.dp->grads());
  out.loss_t = loss_sum.div(static_cast<double>(micro_batches));  // partial when interrupted
  out.sample_losses_t = at::cat(samples).to(at::kDouble);
  out.losses_read = false;
  out.sample_ids = ids;
}

}  // namespace

void forward_backward(Job& job, RankStep& s, int64_t step) {
  std::vector<int64_t> ids;
  for (int64_t m = 0; m < job.config.training.gradient_accumulation_steps; ++m) {
    const std::vector<int64_t> next = job.sampler->next_ids();
    ids.insert(ids.end(), next.begin(), next.end());
  }
  run_batch(job, step, job.ranks.rank, 0, ids, s);
}

void bystand(Job& job) {
  for (int64_t m = 0; m < job.config.training.gradient_accumulation_steps; ++m)
    job.dp->bystand_computation();
}

void check_local(Job& job, RankStep& s) {
  s.local_checked = job.config.diagnostics.local_check;
  if (job.local_check) s.local_stats = job.local_check->run().clone();  // its buffer is reused
  else if (s.local_checked) s.local_stats = job.dp->local_stats();  // fsdp: unit by unit
  s.local_read = false;
  // On a probed step the probe compares a replay's gradient bytes with these: on the CPU only,
  // where a replay reproduces bit for bit (a GPU's compares within a tolerance; fsdp's own
  // gradient is gone unit by unit). The step being computed is the one after job.state's (the
  // probe decides on the host).
  if (job.config.diagnostics.replay_every > 0 && job.local_check && !job.device.is_cuda() &&
      job.triager->needs_input(job.state.step + 1))
    s.gradient_crc = static_cast<double>(tensors_crc32_value(job.dp->grads()));
}

void read_to_host(RankStep& s) {
  if (!s.losses_read && s.loss_t.defined()) {  // one read: the loss, then every sample's
    const at::Tensor host = at::cat({s.loss_t.reshape({1}), s.sample_losses_t}).cpu();
    const double* v = host.const_data_ptr<double>();
    s.loss = v[0];
    s.sample_losses.assign(v + 1, v + host.numel());
    s.losses_read = true;
  }
  if (!s.local_read && s.local_stats.defined()) {
    s.local = GradCheck::read(s.local_stats);
    s.local_read = true;
  }
  if (!s.shard_read && s.shard_stats.defined()) {
    s.shard = GradCheck::read(s.shard_stats);
    s.shard_read = true;
  }
}

TriageInput triage_input(const Job& job, RankStep& s, int64_t step) {
  if (!job.triager->needs_input(step)) return {};
  read_to_host(s);
  return {rank_stats(s.local, {}, s.loss, s.sample_losses, false), s.sample_ids, s.sample_losses,
          s.gradient_crc};
}

Recompute replayer(Job& job, RankStep& s, int64_t step) {
  return [&job, &s, step, computations = 0](int batch_rank, const std::vector<int64_t>& ids,
                                             bool keep) mutable {
    at::Tensor saved;
    if (!keep) saved = job.dp->gradient_buffer().clone();
    job.dp->zero_grad();
    RankStep replay;
    run_batch(job, step, batch_rank, ++computations, ids, replay);
    check_local(job, replay);
    read_to_host(replay);
    const ReplayNumbers n{replay.loss, replay.local.sumsq, replay.local.nonfinite,
                          replay.gradient_crc};
    if (keep) {  // the recomputed numbers, on the host and on the device
      for (at::Tensor RankStep::*f : {&RankStep::loss_t, &RankStep::sample_losses_t,
                                      &RankStep::local_stats})
        s.*f = replay.*f;
      s.loss = replay.loss;
      s.sample_losses = replay.sample_losses;
      s.local = replay.local;
    } else {
      job.dp->gradient_buffer().copy_(saved);
    }
    job.faults->begin_computation(job.ranks.rank, computations);  // no fault on later work
    return n;
  };
}

}  // namespace lockstep
