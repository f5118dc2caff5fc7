// A model's forward in units, each a function of the previous unit's output (llama: the token
// embeddings, each transformer block, the final norm with the output layer). Two things act on
// whole units:
//  - activation recomputation (activation_checkpoint.mode): a block's forward runs without
//    keeping its activations, only its input; its backward runs the forward again (the same
//    dropout masks: the random generators' states are replayed) and back-propagates through it,
//    so the gradients are the same bits as without;
//  - fsdp's parameter gathering (UnitHooks): the unit's parameters are gathered before its
//    forward and freed after it, and gathered again before its backward.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <utility>
#include <vector>

namespace lockstep {

// What a data-parallel mode does around each unit (fsdp.cpp). Called on the thread that runs the
// forward, and (before_backward) on autograd's.
class UnitHooks {
 public:
  virtual ~UnitHooks() = default;
  virtual void before_forward(int unit) = 0;  // its parameters must hold their values now
  virtual void after_forward(int unit) = 0;   // the forward (or its recomputation) is done
  // The gradient of the unit's output is complete: its backward (after a recomputation, if it
  // recomputes) runs next.
  virtual void before_backward(int unit) = 0;
};

class Units {
 public:
  using Fn = std::function<at::Tensor(const at::Tensor&)>;

  // The next unit in forward order: the indices of its parameters (into Model::parameters()).
  void add(std::vector<int> params) { params_.push_back(std::move(params)); }

  // Unit `unit`'s forward of x: fn(x), recomputed in backward when the unit is set to, with the
  // hooks around it. fn may run again in backward: it must capture by value.
  at::Tensor run(int unit, const at::Tensor& x, const Fn& fn) const;

  // Which units recompute (activation_checkpoint: transformer blocks only, as
  // recomputed_blocks in lockstep/model_size.h says).
  void set_recompute(std::vector<bool> recompute) { recompute_ = std::move(recompute); }
  void set_hooks(UnitHooks* hooks) { hooks_ = hooks; }

  // The last unit added also reads unit `unit`'s parameters (a head tied to the embedding):
  // fsdp keeps that unit gathered while it computes, as FSDP2 keeps a tied weight in one unit.
  void last_also_reads(int unit) { reads_.push_back({size() - 1, unit}); }

  int size() const { return static_cast<int>(params_.size()); }
  const std::vector<int>& params(int unit) const { return params_.at(unit); }
  // The unit that unit `unit` also reads, or -1.
  int also_reads(int unit) const {
    for (const auto& [u, r] : reads_)
      if (u == unit) return r;
    return -1;
  }

 private:
  std::vector<std::vector<int>> params_;
  std::vector<std::pair<int, int>> reads_;  // (unit, the unit it also reads)
  std::vector<bool> recompute_;
  UnitHooks* hooks_ = nullptr;
};

}  // namespace lockstep
