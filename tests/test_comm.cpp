// Gloo collectives through c10d: N ranks as N threads over a FileStore, exact expected values.
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <gtest/gtest.h>

#include <chrono>
#include <unistd.h>

#include <thread>

#include "comm/comm.h"
#include "comm_util.h"
#include "lockstep/error.h"
#include "test_util.h"

using namespace lockstep;

using test::on_ranks;

TEST(CommGloo, CollectivesGiveExactValues) {
  for (int size : {1, 2, 3}) {
    on_ranks(size, [size](Comm& c) {
      EXPECT_EQ(c.size(), size);
      EXPECT_EQ(c.backend(), "gloo");
      at::Tensor t = at::full({5}, static_cast<double>(c.rank() + 1), at::kDouble);
      c.all_reduce_sum(t);
      for (int i = 0; i < 5; ++i) EXPECT_EQ(t[i].item<double>(), size * (size + 1) / 2.0);

      at::Tensor b = at::full({3}, static_cast<float>(c.rank() * 10), at::kFloat);
      c.broadcast(b, size - 1);
      EXPECT_EQ(b[2].item<float>(), (size - 1) * 10.0f);

      at::Tensor in = at::arange(4, at::kLong).add(100 * c.rank());
      at::Tensor out = at::empty({size, 4}, at::kLong);
      c.all_gather(in, out);
      for (int r = 0; r < size; ++r) EXPECT_EQ(out[r][3].item<int64_t>(), 100 * r + 3);

      // Block b of rank r holds 1000 b + r (+ i): rank b receives the sum over r of that.
      at::Tensor rs_in = at::empty({size * 3}, at::kFloat);
      for (int b = 0; b < size; ++b)
        for (int i = 0; i < 3; ++i)
          rs_in[b * 3 + i].fill_(static_cast<float>(1000 * b + c.rank() + i));
      at::Tensor rs_out = at::empty({3}, at::kFloat);
      c.reduce_scatter_sum(rs_in, rs_out);
      for (int i = 0; i < 3; ++i)
        EXPECT_EQ(rs_out[i].item<float>(),
                  static_cast<float>(size * (1000 * c.rank() + i) + size * (size - 1) / 2))
            << "element " << i;

      // Several collectives in flight at once, completed later and in any order.
      at::Tensor x = at::full({4}, static_cast<double>(c.rank()), at::kDouble);
      at::Tensor y = at::full({3}, 1.0, at::kFloat);
      auto wx = c.all_reduce_sum_async(x);
      auto wy = c.all_reduce_sum_async(y);
      at::Tensor g = at::empty({size, 2}, at::kLong);
      auto wg = c.all_gather_async(at::full({2}, 7 * c.rank(), at::kLong), g);
      wy->wait();
      wx->wait();
      wg->wait();
      wg->wait();  // a second wait does nothing
      EXPECT_EQ(x[0].item<double>(), size * (size - 1) / 2.0);
      EXPECT_EQ(y[2].item<float>(), static_cast<float>(size));
      EXPECT_EQ(g[size - 1][1].item<int64_t>(), 7 * (size - 1));
      c.barrier();
    });
  }
}

TEST(CommGloo, AMissingRankTimesOutInsteadOfHanging) {
  test::TempDir dir;
  CommOptions o;
  o.init_timeout_seconds = 20;
  o.train_timeout_seconds = 2;
  std::string error;
  std::atomic<bool> done{false};
  std::thread peer([&] {  // joins, then never takes part in the collective
    auto comm = make_comm_file_store(dir / "store", 1, 2, o);
    while (!done) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  });
  const auto start = std::chrono::steady_clock::now();
  try {
    auto comm = make_comm_file_store(dir / "store", 0, 2, o);
    at::Tensor t = at::full({4}, 1.0, at::kFloat);
    comm->all_reduce_sum(t);
  } catch (const Error& e) {
    error = e.what();
  }
  done = true;
  peer.join();
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(error.find("gloo all_reduce failed on rank 0 of 2"), std::string::npos) << error;
  // The roll call names the rank that never came (alive, but not at the collective).
  EXPECT_NE(error.find("rank 1 did not arrive within 1 s of this rank's timeout"),
            std::string::npos)
      << error;
  EXPECT_LT(secs, 15.0);
}

TEST(CommFactory, ResolvesAutoAndRefusesWhatCannotWork) {
  const c10::Device cpu(c10::kCPU);
  EXPECT_EQ(resolve_backend(Backend::kAuto, cpu), Backend::kGloo);
  EXPECT_EQ(resolve_backend(Backend::kGloo, cpu), Backend::kGloo);
  auto error = [&](Backend b) {
    try {
      resolve_backend(b, cpu);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  // NCCL moves GPU memory: refused for CPU tensors, naming the key and the way out.
  EXPECT_NE(error(Backend::kNccl).find("'parallelism.backend': \"nccl\" moves GPU memory"),
            std::string::npos);
  EXPECT_EQ(error(Backend::kMpi) == "accepted", mpi_available());
  // A node whose ranks outnumber its GPUs: "auto" takes Gloo (the GPUs are shared); "nccl" is
  // refused before NCCL fails on a duplicate GPU, saying how many ranks fit.
  const c10::Device gpu(c10::kCUDA, 0);
  EXPECT_EQ(resolve_backend(Backend::kAuto, gpu, 2, 1), Backend::kGloo);
  try {
    resolve_backend(Backend::kNccl, gpu, 2, 1);
    ADD_FAILURE() << "2 ranks on 1 GPU accepted with nccl";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("this node runs 2 ranks on 1 GPU(s)"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("at most 1 ranks per node"), std::string::npos);
  }
  // The store path serves gloo and nccl only; nccl needs a CUDA build.
  CommOptions o;
  o.backend = Backend::kMpi;
  EXPECT_THROW(make_comm_file_store("/tmp/unused", 0, 1, o), std::invalid_argument);
  if (nccl_available()) return;  // a CUDA build: tests/test_comm_nccl.cpp runs it on a GPU
  o.backend = Backend::kNccl;
  try {
    make_comm_file_store("/tmp/unused", 0, 1, o);
    FAIL() << "nccl without CUDA must be refused";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("LOCKSTEP_CUDA=OFF"), std::string::npos) << e.what();
  }
}

TEST(CommGloo, RendezvousThroughATcpStoreWithTorchrunPrefix) {
  // Two ranks as threads, rank 0 serving the TCPStore, keys under /worker/attempt_1.
  const int port = test::free_port();
  std::vector<std::string> errors(2);
  std::vector<double> sums(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      try {
        RankInfo ranks;
        ranks.rank = r;
        ranks.world_size = ranks.local_world_size = 2;
        ranks.local_rank = r;
        ranks.master_port = port;
        ranks.launcher = "torchrun";
        ranks.restart_count = 1;
        CommOptions o;
        o.init_timeout_seconds = 30;
        auto comm = make_c10d_comm(ranks, o);
        at::Tensor t = at::full({2}, static_cast<double>(r + 1), at::kDouble);
        comm->all_reduce_sum(t);
        sums[r] = t[1].item<double>();
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(sums[r], 3.0) << "rank " << r;
  }
}
