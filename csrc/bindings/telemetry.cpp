// Telemetry (csrc/telemetry/, csrc/probe/): latency histograms and their buckets,
// LatencyRecorder, the monotonic clock, and the device probe (run_probe) that reports in them.
#include "bindings/bindings.hpp"

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "probe/probe.hpp"
#include "telemetry/histogram.hpp"
#include "telemetry/recorder.hpp"

namespace flashstream::bindings {
namespace {

// A numpy array owning a copy of `n` values: independent of the C++ object they came from.
U64Array copy_to_numpy(const uint64_t* src, size_t n) {
  std::unique_ptr<uint64_t[]> copy(new uint64_t[n ? n : 1]);
  std::memcpy(copy.get(), src, n * sizeof(uint64_t));
  nb::capsule owner(copy.get(), [](void* p) noexcept { delete[] static_cast<uint64_t*>(p); });
  return U64Array(copy.release(), {n}, owner);
}

}  // namespace

U64Array latency_counts(const LatencyHistogram& h) {
  return copy_to_numpy(h.counts(), LatencyHistogram::kBuckets);
}

void put_histogram(nb::dict& d, const LatencyHistogram& h) {
  d["counts"] = latency_counts(h);
  d["min_ns"] = h.min();
  d["max_ns"] = h.max();
  d["sum_ns"] = h.sum();
}

namespace {

// Lower bound (ns) of every latency histogram bucket; bucket i is [b[i], b[i+1]), and the last
// has the width of the one before it.
U64Array histogram_bounds() {
  std::vector<uint64_t> bounds(LatencyHistogram::kBuckets);
  for (size_t i = 0; i < bounds.size(); ++i) bounds[i] = LatencyHistogram::bucket_lower(i);
  return copy_to_numpy(bounds.data(), bounds.size());
}

// A flag another thread sets to end a probe run early (ProbeSpec::cancel).
struct ProbeCancel {
  std::atomic<bool> flag{false};
};

nb::dict run_probe_py(const std::string& path, const std::string& op, const std::string& pattern,
                      size_t block_size, unsigned queue_depth, uint64_t bytes, double duration,
                      const std::string& engine, bool direct, uint64_t seed, double interval,
                      double stop_below, double stop_after, double stop_smooth,
                      const ProbeCancel* cancel) {
  ProbeSpec spec;
  spec.path = path;
  spec.op = parse_probe_op(op);  // std::invalid_argument -> ValueError
  spec.pattern = parse_probe_pattern(pattern);
  spec.block_size = block_size;
  spec.queue_depth = queue_depth;
  spec.bytes = bytes;
  spec.duration = duration;
  spec.engine = engine;
  spec.direct = direct;
  spec.seed = seed;
  spec.interval = interval;
  spec.stop_below = stop_below;
  spec.stop_after = stop_after;
  spec.stop_smooth = stop_smooth;
  spec.cancel = cancel ? &cancel->flag : nullptr;
  ProbeResult r;
  {
    nb::gil_scoped_release release;
    r = run_probe(spec);
  }
  nb::list timeline;
  for (const TimelinePoint& p : r.timeline) timeline.append(nb::make_tuple(p.seconds, p.bytes));
  nb::dict d;
  d["bytes"] = r.bytes;
  d["seconds"] = r.seconds;
  d["sync_seconds"] = r.sync_seconds;
  d["requests"] = r.requests;
  d["direct"] = r.direct;
  d["engine"] = r.engine;
  put_histogram(d, r.latency);
  d["timeline"] = timeline;
  return d;
}

void create_probe_file_py(const std::string& path, uint64_t size) {
  nb::gil_scoped_release release;
  create_probe_file(path, size);
}

}  // namespace

void bind_telemetry(nb::module_& m) {
  m.def("histogram_bounds", &histogram_bounds,
        "Lower bound in ns of each latency histogram bucket (uint64 array, one per count).");
  m.def("run_probe", &run_probe_py, nb::arg("path"), nb::arg("op") = "read",
        nb::arg("pattern") = "sequential", nb::arg("block_size") = size_t(1) << 20,
        nb::arg("queue_depth") = 32u, nb::arg("bytes") = uint64_t(0), nb::arg("duration") = 0.0,
        nb::arg("engine") = "auto", nb::arg("direct") = true, nb::arg("seed") = uint64_t(0),
        nb::arg("interval") = 0.0, nb::arg("stop_below") = 0.0, nb::arg("stop_after") = 0.0,
        nb::arg("stop_smooth") = 0.0, nb::arg("cancel").none() = nb::none(),
        "Measure the device like fio: queue_depth requests of block_size in flight on an "
        "existing file; stop issuing once stop_after seconds have passed since the timeline "
        "last ran at stop_below bytes/s or faster (each rate the mean over stop_smooth seconds; "
        "0: never), or once `cancel` (a ProbeCancel) is set. Returns "
        "a dict (bytes, seconds, sync_seconds, requests, direct, engine, counts, min_ns, "
        "max_ns, sum_ns, timeline).");
  nb::class_<ProbeCancel>(m, "ProbeCancel",
                          "Ends a run_probe in progress from another thread (its requests in "
                          "flight complete).")
      .def(nb::init<>())
      .def("set", [](ProbeCancel& c) { c.flag.store(true); }, "Stop issuing.")
      .def("is_set", [](const ProbeCancel& c) { return c.flag.load(); });
  m.def("create_probe_file", &create_probe_file_py, nb::arg("path"), nb::arg("size"),
        "Create or resize a preallocated file of random data for run_probe.");

  nb::class_<LatencyRecorder>(m, "LatencyRecorder",
                              "Thread-safe latency histogram (csrc/telemetry/recorder.hpp).")
      .def(nb::init<>())
      .def("record", &LatencyRecorder::record, nb::arg("ns"), "Add one latency (ns).")
      .def("stop", &LatencyRecorder::stop, nb::arg("start_ns"),
           "Record monotonic now - start_ns (time.perf_counter_ns's clock); returns it.")
      .def("snapshot", [](LatencyRecorder& r, bool reset) {
             const LatencyHistogram h = r.snapshot(reset);
             nb::dict d;
             put_histogram(d, h);
             return d;
           }, nb::arg("reset") = false,
           "dict for LatencyHistogram.from_core; reset=True starts over with this copy.");
  m.def("monotonic_ns", &monotonic_ns, "CLOCK_MONOTONIC in ns (time.perf_counter_ns's clock).");
}

}  // namespace flashstream::bindings
