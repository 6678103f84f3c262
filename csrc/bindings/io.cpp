// The engines and streaming reads (csrc/io/): uring_available, Reader (the sequential reader
// behind shard streaming) and RangeFile (scattered reads, the inverted-list fetch).
#include "bindings/bindings.hpp"

#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/owner_process.hpp"
#include "io/engine.hpp"
#include "io/range_reader.hpp"
#include "io/sequential_reader.hpp"

namespace flashstream::bindings {
namespace {

using ByteView = nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// A SequentialReader driven from Python. Calls release the GIL, so two threads may call at once:
// `mu_` serializes them (close() waits for a next() in progress). A chunk's view keeps this
// object alive and close() keeps the chunk buffers, so a view read after close() still reads this
// reader's memory. In a fork() child every call but close() raises RuntimeError (ForkedError),
// without taking `mu_` (a thread of the parent may have held it), and nothing is torn down
// there: see common/owner_process.hpp.
class PyReader {
 public:
  PyReader(const std::vector<std::tuple<nb::bytes, uint64_t, uint64_t>>& extents,
           size_t chunk_size, unsigned queue_depth, const std::string& engine, bool direct) {
    if (chunk_size == 0) throw nb::value_error("chunk_size must be positive");
    if (queue_depth == 0) throw nb::value_error("queue_depth must be positive");
    std::vector<Extent> list;
    list.reserve(extents.size());
    for (const auto& [path, start, end] : extents)
      list.push_back({std::string(path.c_str(), path.size()), start, end});
    ReaderOptions options;
    options.chunk_size = chunk_size;
    options.queue_depth = queue_depth;
    options.engine = engine;
    options.direct = direct;
    try {
      nb::gil_scoped_release release;  // the constructor opens files and queues reads
      reader_ = std::make_unique<SequentialReader>(std::move(list), options);
    } catch (const std::invalid_argument& e) {
      throw nb::value_error(e.what());
    }
  }

  // (extent, offset, data, first, last), or None after the last chunk. `data` is a zero-copy
  // view of the reader's buffer: its contents are valid until the next call to next() or
  // skip_extent(), and its memory as long as the view lives.
  nb::object next(nb::handle self) {
    Chunk chunk;
    bool more;
    {
      nb::gil_scoped_release release;
      Locked reader(*this);
      more = reader->next(chunk);
    }
    if (!more) return nb::none();
    // A memoryview over a numpy array that keeps this reader (and so its buffers) alive.
    ByteView array(const_cast<uint8_t*>(chunk.data), {chunk.size}, self);
    nb::object view = nb::steal(PyMemoryView_FromObject(nb::cast(array).ptr()));
    if (!view.is_valid()) throw nb::python_error();
    return nb::make_tuple(chunk.extent, chunk.offset, view, chunk.first, chunk.last);
  }

  void skip_extent() {
    nb::gil_scoped_release release;
    Locked reader(*this);
    reader->skip_extent();
  }

  void close() {
    if (!owner_.here()) return;  // a fork() child: the parent's reader is not ours to close
    nb::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(mu_);
    reader_->close();  // waits for reads still in flight
  }

  bool closed() const { return reader_->closed(); }

  std::string engine() const { return reader_->engine_name(); }

  nb::dict stats() {
    ReaderStats s;
    {
      nb::gil_scoped_release release;
      Locked reader(*this, /*allow_closed=*/true);
      s = reader->stats();
    }
    nb::dict d;
    d["bytes_read"] = s.bytes_read;
    d["requests"] = s.requests;
    d["short_reads"] = s.short_reads;
    d["direct_files"] = s.direct_files;
    d["buffered_files"] = s.buffered_files;
    d["wait_ns"] = s.wait_ns;
    d["latency_count"] = s.latency.count();
    d["latency_sum_ns"] = s.latency.sum();
    d["latency_min_ns"] = s.latency.min();
    d["latency_max_ns"] = s.latency.max();
    return d;
  }

  U64Array latency_counts() {
    LatencyHistogram h;
    {
      nb::gil_scoped_release release;
      Locked reader(*this, /*allow_closed=*/true);
      h = reader->stats().latency;
    }
    return bindings::latency_counts(h);
  }

 private:
  // The reader under `mu_`, checked for the owning process first (before locking) and for close.
  class Locked {
   public:
    explicit Locked(PyReader& r, bool allow_closed = false) : r_(r) {
      r_.owner_.check("this Reader");
      lock_ = std::unique_lock<std::mutex>(r_.mu_);
      if (!allow_closed && r_.reader_->closed()) throw nb::value_error("reader is closed");
    }
    SequentialReader* operator->() { return r_.reader_.get(); }

   private:
    PyReader& r_;
    std::unique_lock<std::mutex> lock_;
  };

  OwnerProcess owner_;
  std::mutex mu_;
  std::unique_ptr<SequentialReader> reader_;
};

// ---- scattered reads ----

// A RangeFile driven from Python: read() converts the ranges, then releases the GIL while the
// requests are in flight, so many threads read through one file at once (RangeFile is
// thread-safe). The destination buffer's export is held for the call, so it cannot be closed
// or resized underneath the reads.
class PyRangeFile {
 public:
  PyRangeFile(nb::bytes path, bool direct) {
    std::string p(path.c_str(), path.size());
    nb::gil_scoped_release release;
    file_ = std::make_unique<RangeFile>(p, direct);
  }

  // ranges: (file offset, length, buffer offset) triples flattened into one uint64 array.
  nb::dict read(nb::handle buffer, U64Array ranges, const std::string& engine,
                unsigned queue_depth, size_t request_size) {
    const size_t n = ranges.shape(0);
    if (n % 3) throw nb::value_error("ranges must be (offset, length, dest) triples");
    BufferView view(buffer, /*writable=*/true);
    std::vector<ReadRange> list(n / 3);
    const uint64_t* v = ranges.data();
    for (size_t i = 0; i < list.size(); ++i) list[i] = {v[3 * i], v[3 * i + 1], v[3 * i + 2]};
    RangeOptions o;
    o.engine = engine;
    o.queue_depth = queue_depth;
    o.request_size = request_size;
    RangeStats s;
    {
      nb::gil_scoped_release release;
      s = file_->read(view.writable_data(), view.size(), list, o);
    }
    nb::dict d;
    d["bytes"] = s.bytes;
    d["requests"] = s.requests;
    d["seconds"] = s.seconds;
    d["max_ns"] = s.max_ns;
    d["sum_ns"] = s.sum_ns;
    d["engine"] = s.engine;
    d["direct"] = s.direct;
    return d;
  }

  void close() {
    nb::gil_scoped_release release;  // waits for reads in progress on other threads
    file_->close();
  }

  bool direct() const { return file_->direct(); }
  uint64_t size() const { return file_->size(); }
  std::tuple<uint32_t, uint32_t> alignment() const {
    return {file_->alignment().offset, file_->alignment().memory};
  }
  nb::bytes path() const { return nb::bytes(file_->path().data(), file_->path().size()); }

 private:
  std::unique_ptr<RangeFile> file_;
};

}  // namespace

void bind_io(nb::module_& m) {
  m.def("uring_available", &uring_available,
        "True when this process can create an io_uring instance.");

  nb::class_<PyReader>(m, "Reader")
      .def(nb::init<const std::vector<std::tuple<nb::bytes, uint64_t, uint64_t>>&, size_t,
                    unsigned, const std::string&, bool>(),
           nb::arg("extents"), nb::arg("chunk_size"), nb::arg("queue_depth"), nb::arg("engine"),
           nb::arg("direct"))
      .def("next", [](nb::handle self) { return nb::cast<PyReader&>(self).next(self); })
      .def("skip_extent", &PyReader::skip_extent)
      .def("close", &PyReader::close)
      .def_prop_ro("closed", &PyReader::closed)
      .def_prop_ro("engine", &PyReader::engine)
      .def("stats", &PyReader::stats)
      .def("latency_counts", &PyReader::latency_counts,
           "Copy of the per-request latency histogram counts (see histogram_bounds()).");

  nb::class_<PyRangeFile>(m, "RangeFile",
                         "One file opened for scattered reads into a caller's buffer.")
      .def(nb::init<nb::bytes, bool>(), nb::arg("path"), nb::arg("direct"))
      .def("read", &PyRangeFile::read, nb::arg("buffer"), nb::arg("ranges"), nb::arg("engine"),
           nb::arg("queue_depth"), nb::arg("request_size"),
           "Read each (offset, length, dest) range of the file into buffer[dest:dest+length], "
           "all in flight together. Returns a dict (bytes, requests, seconds, max_ns, sum_ns, "
           "engine, direct).")
      .def("close", &PyRangeFile::close)
      .def_prop_ro("direct", &PyRangeFile::direct)
      .def_prop_ro("size", &PyRangeFile::size)
      .def_prop_ro("alignment", &PyRangeFile::alignment)
      .def_prop_ro("path", &PyRangeFile::path);
}

}  // namespace flashstream::bindings
