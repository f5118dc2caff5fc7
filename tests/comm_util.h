// N ranks as N threads of this process, over a c10d FileStore (Gloo).
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "comm/comm.h"
#include "test_util.h"

namespace lockstep::test {

// Runs fn(comm) on `size` ranks, one thread each; failures are collected per rank.
inline void on_ranks(int size, const std::function<void(Comm&)>& fn, CommOptions o = {}) {
  TempDir dir;
  std::vector<std::thread> threads;
  std::vector<std::string> errors(size);
  for (int r = 0; r < size; ++r)
    threads.emplace_back([&, r] {
      try {
        auto comm = make_comm_file_store(dir / "store", r, size, o);
        fn(*comm);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < size; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

}  // namespace lockstep::test
