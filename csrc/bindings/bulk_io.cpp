// Checkpoint I/O (csrc/io/bulk_file.hpp, csrc/io/pacing.hpp): pacing (AdaptiveRate,
// RateControl, Pacer) and whole-file writes and reads (OutputFile, read_file_into).
#include "bindings/bindings.hpp"

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "io/bulk_file.hpp"
#include "io/pacing.hpp"

namespace flashstream::bindings {
namespace {

AdaptiveConfig adaptive_config(double window, double cliff_ratio, unsigned cliff_windows,
                               double margin, double min_rate) {
  AdaptiveConfig c;
  c.window = window;
  c.cliff_ratio = cliff_ratio;
  c.cliff_windows = cliff_windows;
  c.margin = margin;
  c.min_rate = min_rate;
  return c;
}

// `adaptive` is a dict of AdaptiveRate's keyword arguments ({} for the defaults).
AdaptiveConfig adaptive_config(const nb::dict& kw) {
  AdaptiveConfig c;
  for (auto [key, value] : kw) {
    const std::string k = nb::cast<std::string>(key);
    if (k == "window") c.window = nb::cast<double>(value);
    else if (k == "cliff_ratio") c.cliff_ratio = nb::cast<double>(value);
    else if (k == "cliff_windows") c.cliff_windows = nb::cast<unsigned>(value);
    else if (k == "margin") c.margin = nb::cast<double>(value);
    else if (k == "min_rate") c.min_rate = nb::cast<double>(value);
    else
      throw nb::value_error(("unknown adaptive setting '" + k +
                             "' (allowed: window, cliff_ratio, cliff_windows, margin, min_rate)")
                                .c_str());
  }
  AdaptiveRate check(c);  // std::invalid_argument -> ValueError before any I/O
  return c;
}

void put_latency(nb::dict& d, const BulkStats& s) {
  d["bytes"] = s.bytes;
  d["seconds"] = s.seconds;
  d["requests"] = s.requests;
  put_histogram(d, s.latency);
  d["engine"] = s.engine;
}

// An OutputFile driven from Python. write() runs with the GIL released, so another thread
// could call close() meanwhile: `busy_` (OneCallAtATime) refuses that.
class PyOutputFile {
 public:
  PyOutputFile(nb::bytes path, uint64_t size, bool direct, bool existing) {
    std::string p(path.c_str(), path.size());
    nb::gil_scoped_release release;  // fallocate may take a while
    file_ = std::make_unique<OutputFile>(p, size, direct, existing);
  }

  nb::dict write(nb::handle data, uint64_t offset, size_t chunk_size, unsigned queue_depth,
                 const std::string& engine, double rate, std::optional<nb::dict> adaptive,
                 std::optional<std::vector<uint64_t>> crc_bounds, double interval,
                 std::shared_ptr<RateControl> control, size_t paced_chunk_size) {
    BulkOptions o;
    o.control = std::move(control);
    o.chunk_size = chunk_size;
    o.paced_chunk_size = paced_chunk_size;
    o.queue_depth = queue_depth;
    o.engine = engine;
    o.rate = rate;
    o.interval = interval;
    if (adaptive) {
      o.adaptive = true;
      o.adaptive_config = adaptive_config(*adaptive);
    }
    std::vector<uint64_t> bounds;
    if (crc_bounds) bounds = std::move(*crc_bounds);
    BufferView view(data);
    std::vector<uint32_t> crcs;
    BulkStats s;
    {
      OneCallAtATime busy(busy_, "OutputFile");
      nb::gil_scoped_release release;
      s = file_->write(view.data(), view.size(), offset, o, bounds, &crcs);
    }
    nb::list timeline;
    for (const RatePoint& p : s.timeline)
      timeline.append(nb::make_tuple(p.seconds, p.bytes, p.rate));
    nb::list crc_list;
    for (uint32_t c : crcs) crc_list.append(c);
    nb::dict d;
    put_latency(d, s);
    d["paused"] = s.paused;
    d["timeline"] = timeline;
    d["peak"] = s.peak;
    d["sustained"] = s.sustained;
    d["final_rate"] = s.final_rate;
    d["crcs"] = crc_list;
    d["direct"] = file_->direct();
    return d;
  }

  double commit(uint64_t size) {
    OneCallAtATime busy(busy_, "OutputFile");
    nb::gil_scoped_release release;
    return file_->commit(size);
  }

  void close() {
    if (busy_) throw nb::value_error("close() while a write is in progress");
    file_->close();
  }

  bool direct() const { return file_->direct(); }
  std::tuple<uint32_t, uint32_t> alignment() const {
    return {file_->alignment().offset, file_->alignment().memory};
  }
  nb::bytes path() const { return nb::bytes(file_->path().data(), file_->path().size()); }

 private:
  std::unique_ptr<OutputFile> file_;
  bool busy_ = false;
};

nb::dict read_file_into_py(nb::bytes path, nb::handle data, uint64_t length, size_t chunk_size,
                           unsigned queue_depth, const std::string& engine, bool direct) {
  BufferView view(data, /*writable=*/true);
  if (length > view.size())
    throw nb::value_error(("length " + std::to_string(length) + " exceeds the buffer's " +
                           std::to_string(view.size()) + " bytes").c_str());
  BulkOptions o;
  o.chunk_size = chunk_size;
  o.queue_depth = queue_depth;
  o.engine = engine;
  std::string p(path.c_str(), path.size());
  bool is_direct = false;
  BulkStats s;
  {
    nb::gil_scoped_release release;
    s = read_file_into(p, view.writable_data(), length, view.size(), o, direct, &is_direct);
  }
  nb::dict d;
  put_latency(d, s);
  d["direct"] = is_direct;
  return d;
}

}  // namespace

void bind_bulk_io(nb::module_& m) {
  nb::class_<AdaptiveRate>(m, "AdaptiveRate",
                           "Finds a drive's write cliff from per-window throughput and paces "
                           "below its sustained rate (see csrc/io/pacing.hpp).")
      .def("__init__",
           [](AdaptiveRate* self, double window, double cliff_ratio, unsigned cliff_windows,
              double margin, double min_rate) {
             new (self) AdaptiveRate(
                 adaptive_config(window, cliff_ratio, cliff_windows, margin, min_rate));
           },
           nb::kw_only(), nb::arg("window") = 0.1, nb::arg("cliff_ratio") = 0.5,
           nb::arg("cliff_windows") = 2u, nb::arg("margin") = 0.9,
           nb::arg("min_rate") = 16.0 * 1024 * 1024)
      .def("observe", &AdaptiveRate::observe, nb::arg("bytes"), nb::arg("seconds"),
           "One finished window; returns the rate to pace at from now on (0: unpaced).")
      .def_prop_ro("rate", &AdaptiveRate::rate)
      .def_prop_ro("peak", &AdaptiveRate::peak)
      .def_prop_ro("sustained", &AdaptiveRate::sustained)
      .def_prop_ro("cliff", &AdaptiveRate::cliff)
      .def_prop_ro("window", [](const AdaptiveRate& a) { return a.config().window; })
      .def_prop_ro("cliff_ratio", [](const AdaptiveRate& a) { return a.config().cliff_ratio; })
      .def_prop_ro("cliff_windows", [](const AdaptiveRate& a) { return a.config().cliff_windows; })
      .def_prop_ro("margin", [](const AdaptiveRate& a) { return a.config().margin; })
      .def_prop_ro("min_rate", [](const AdaptiveRate& a) { return a.config().min_rate; });

  nb::class_<RateControl>(m, "RateControl",
                          "A write's pacing rate, set from another thread while it runs, and its "
                          "progress (see csrc/io/pacing.hpp).")
      .def(nb::init<>())
      .def_prop_rw(
          "rate", [](const RateControl& c) { return c.rate.load(); },
          [](RateControl& c, double r) {
            if (!(r >= 0)) throw nb::value_error("rate must be >= 0 bytes/s (0: unpaced)");
            c.rate.store(r);
          },
          "Bytes/s from now on; 0: unpaced.")
      .def_prop_ro(
          "done", [](const RateControl& c) { return c.done.load(); },
          "Bytes the write has completed so far.")
      .def(
          "add_done", [](RateControl& c, uint64_t n) { c.done.fetch_add(n); }, nb::arg("bytes"),
          "Counts completed bytes (for writers outside the C++ core).");

  nb::class_<Pacer>(m, "Pacer", "Fixed-rate schedule without an initial burst (rate 0: unpaced).")
      .def(nb::init<double>(), nb::arg("rate") = 0.0)
      .def("admit", &Pacer::admit, nb::arg("bytes"), nb::arg("now"),
           "Seconds to wait before submitting `bytes` at time `now`.")
      .def("set_rate", &Pacer::set_rate, nb::arg("rate"), nb::arg("now"))
      .def_prop_ro("rate", &Pacer::rate);

  nb::class_<PyOutputFile>(m, "OutputFile")
      .def(nb::init<nb::bytes, uint64_t, bool, bool>(), nb::arg("path"), nb::arg("size"),
           nb::arg("direct"), nb::arg("existing") = false)
      .def("write", &PyOutputFile::write, nb::arg("data"), nb::arg("offset"),
           nb::arg("chunk_size"), nb::arg("queue_depth"), nb::arg("engine"),
           nb::arg("rate") = 0.0, nb::arg("adaptive").none() = nb::none(),
           nb::arg("crc_bounds").none() = nb::none(), nb::arg("interval") = 0.05,
           nb::arg("control").none() = nb::none(), nb::arg("paced_chunk_size") = 0,
           "Write a contiguous buffer at `offset` (blocks, GIL released; the buffer must not "
           "change meanwhile); a RateControl `control` alone sets the pace; while paced, "
           "requests are at most `paced_chunk_size` bytes (0: chunk_size). Returns a dict "
           "(bytes, seconds, requests, counts, min_ns, max_ns, sum_ns, paused, timeline, peak, "
           "sustained, final_rate, crcs, engine, direct).")
      .def("commit", &PyOutputFile::commit, nb::arg("size"),
           "Truncate to `size`, fdatasync, close; returns the seconds the sync took.")
      .def("close", &PyOutputFile::close)
      .def_prop_ro("direct", &PyOutputFile::direct)
      .def_prop_ro("alignment", &PyOutputFile::alignment)
      .def_prop_ro("path", &PyOutputFile::path);

  m.def("read_file_into", &read_file_into_py, nb::arg("path"), nb::arg("data"),
        nb::arg("length"), nb::arg("chunk_size"), nb::arg("queue_depth"), nb::arg("engine"),
        nb::arg("direct"),
        "Read the file's first `length` bytes into a writable buffer (room for the length "
        "rounded up to the O_DIRECT alignment). Returns a dict (bytes, seconds, requests, "
        "counts, min_ns, max_ns, sum_ns, engine, direct).");
}

}  // namespace flashstream::bindings
