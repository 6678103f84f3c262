// Factories behind make_engine(); internal to csrc/io.
#pragma once

#include <memory>

#include "io/engine.hpp"

namespace flashstream {

// io_uring through raw syscalls. Throws IoError(op="io_uring_setup") when unavailable.
std::unique_ptr<IoEngine> make_uring_engine(unsigned depth, bool single_thread);

// pread/pwrite on min(depth, 16) worker threads.
std::unique_ptr<IoEngine> make_thread_engine(unsigned depth);

// Probes io_uring_setup (and IORING_OP_READ/WRITE support) without caching. Returns 0 when usable,
// else a positive errno explaining why not.
int probe_uring();

// Depth clamp shared by the engines: at least 1, at most this.
constexpr unsigned kMaxEngineDepth = 4096;

}  // namespace flashstream
