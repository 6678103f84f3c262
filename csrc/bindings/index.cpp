// Shard indexing (csrc/index/): index_shards, with each shard's error as the Python exception
// the reader would have raised.
#include "bindings/bindings.hpp"

#include <exception>
#include <string>
#include <vector>

#include "index/shard_indexer.hpp"

namespace flashstream::bindings {
namespace {

// The exception a shard's indexing ended with, as the Python exception the reader would raise
// (OSError subclass, FormatError, or RuntimeError for anything else).
nb::object exception_object(const std::exception_ptr& error) {
  PyObject* exc = nullptr;
  try {
    std::rethrow_exception(error);
  } catch (const IoError& e) {
    exc = make_os_error(e);
  } catch (const FormatError& e) {
    exc = make_format_error(e);
  } catch (const std::exception& e) {
    exc = PyObject_CallFunction(PyExc_RuntimeError, "s", e.what());
  }
  if (exc == nullptr) throw nb::python_error();
  return nb::steal(exc);
}

const char* outcome_name(ShardOutcome outcome) {
  switch (outcome) {
    case ShardOutcome::kIndexed: return "indexed";
    case ShardOutcome::kFailed: return "failed";
    case ShardOutcome::kCompressed: return "compressed";
    case ShardOutcome::kNeedsFullScan: return "full_scan";
  }
  return "?";
}

nb::tuple index_shards_py(const std::vector<nb::bytes>& paths, const std::string& engine,
                          unsigned queue_depth, bool direct, size_t chunk_size, size_t hop_read,
                          uint64_t hop_threshold, unsigned decide_after) {
  std::vector<std::string> list;
  for (const nb::bytes& p : paths) list.emplace_back(p.c_str(), p.size());
  IndexOptions options;
  options.engine = engine;
  options.queue_depth = queue_depth;
  options.direct = direct;
  options.chunk_size = chunk_size;
  options.hop_read = hop_read;
  options.hop_threshold = hop_threshold;
  options.decide_after = decide_after;
  // A pending signal (Ctrl-C) stops the scan; its Python exception stays set on this thread
  // and is raised once the GIL is back.
  options.cancelled = [] {
    nb::gil_scoped_acquire acquire;
    return PyErr_CheckSignals() != 0;
  };
  IndexStats stats;
  std::vector<ShardIndexResult> results;
  try {
    nb::gil_scoped_release release;
    results = index_shards(list, options, &stats);
  } catch (const IndexCancelled&) {
    throw nb::python_error();
  }
  nb::list out;
  for (const ShardIndexResult& r : results) {
    nb::object error = r.error ? exception_object(r.error) : nb::none();
    out.append(nb::make_tuple(outcome_name(r.outcome), copy_i64(r.offsets), copy_i64(r.ends),
                              error, r.sequential, r.hops));
  }
  nb::dict d;
  d["bytes_read"] = stats.bytes_read;
  d["requests"] = stats.requests;
  d["engine"] = stats.engine;
  return nb::make_tuple(out, d);
}

}  // namespace

void bind_index(nb::module_& m) {
  m.def("index_shards", &index_shards_py, nb::arg("paths"), nb::arg("engine") = "auto",
        nb::arg("queue_depth") = 32u, nb::arg("direct") = true,
        nb::arg("chunk_size") = size_t(1) << 20, nb::arg("hop_read") = size_t(4096),
        nb::arg("hop_threshold") = uint64_t(64) << 10, nb::arg("decide_after") = 8u,
        "Index tar shards (paths as bytes) by hopping from header to header, or reading "
        "sequentially where members are small. Returns ([(outcome, offsets, ends, error, "
        "sequential, hops), ...], stats dict); outcome is indexed, failed, "
        "compressed or full_scan (left to the caller).");
}

}  // namespace flashstream::bindings
