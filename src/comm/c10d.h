// Between the c10d backends: gloo.cpp makes the store (TCPStore or FileStore) and hands it
// to the process group of its backend; c10d.cpp turns any c10d process group (Gloo, NCCL)
// into a Comm. Included only by files that include c10d.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <memory>
#include <string>

#include "comm/comm.h"

namespace lockstep {

// A c10d process group and what the Comm over it needs to know.
struct C10dGroup {
  c10::intrusive_ptr<c10d::Backend> pg;
  std::string name;           // "gloo" | "nccl": names the backend in errors
  c10::Device stage;          // where the library wants tensors; others are staged (staged.cpp)
  c10d::BarrierOptions barrier;
  std::chrono::milliseconds timeout;  // each collective (comm.train_timeout_seconds)
  int rank, size;
  // Gloo: the host waits for each collective under `timeout` (its deadline). NCCL: a wait only
  // makes the current stream wait for the collective, the host goes on; ProcessGroupNCCL's
  // watchdog (its Options::timeout = `timeout`, TORCH_NCCL_ASYNC_ERROR_HANDLING) ends a hung
  // collective, and the process with it. A timed wait there would busy-poll the host.
  bool host_waits = true;
  // The job's store (Gloo's rendezvous), for the roll call after a collective times out: the
  // ranks that reached one say so there, and the error names those that did not (null: none).
  c10::intrusive_ptr<c10d::Store> store;
};

// A backend's group: Gloo's on the host (`stage` a CPU: the host waits under `timeout`), or
// NCCL's on the GPU `stage` (its barrier on that device, no host waits).
C10dGroup group_of(c10::intrusive_ptr<c10d::Backend> pg, c10::Device stage,
                   std::chrono::milliseconds timeout, int rank, int size);

// The Comm over a c10d process group (c10d.cpp), behind the staging decorator.
std::unique_ptr<Comm> comm_over(C10dGroup group);

// nccl.cpp; throws ConfigError in builds without CUDA.
std::unique_ptr<Comm> make_nccl_comm(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                     const CommOptions& options);

std::chrono::milliseconds to_ms(double seconds);
// c10d errors carry a backtrace after the first line; the message is the first line.
std::string first_line(const std::string& s);

}  // namespace lockstep
