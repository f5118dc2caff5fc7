// Between the c10d backends: comm_gloo.cpp makes the store (TCPStore or FileStore) and hands it
// to the NCCL process group in comm_nccl.cpp. Included only by files that include c10d.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <memory>

#include "comm.h"

namespace lockstep {

// comm_nccl.cpp; throws ConfigError in builds without CUDA.
std::unique_ptr<Comm> make_nccl_comm(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                     const CommOptions& options);

}  // namespace lockstep
