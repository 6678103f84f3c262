// The only file that sees Python headers. It converts arguments, releases the GIL around I/O
// and scanning, maps C++ errors to Python exceptions, and turns scanned samples into the dicts
// webdataset yields. Only flashstream/engine.py imports this module.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/crc32c.hpp"
#include "common/errors.hpp"
#include "common/owner_process.hpp"
#include "io/bulk_file.hpp"
#include "io/engine.hpp"
#include "io/pacing.hpp"
#include "io/range_reader.hpp"
#include "io/sequential_reader.hpp"
#include "probe/probe.hpp"
#include "snapshot/copy_ranges.hpp"
#include "snapshot/cow_snapshot.hpp"
#include "index/shard_indexer.hpp"
#include "tar/batch_packer.hpp"
#include "tar/tar_scanner.hpp"
#include "telemetry/histogram.hpp"
#include "telemetry/recorder.hpp"

namespace nb = nanobind;
using namespace flashstream;

namespace {

PyObject* g_format_error = nullptr;  // flashstream._core.FormatError (a ValueError)

// OSError(errno, strerror, filename) picks the subclass (FileNotFoundError, ...) from errno.
// Returns a new reference, or null with a Python error set.
PyObject* make_os_error(const IoError& e) {
  std::string text = std::strerror(e.error_code());
  text += " (" + e.op();
  if (e.offset() >= 0) text += " at offset " + std::to_string(e.offset());
  text += ")";
  // Paths are bytes in the core; decode as the filesystem does (surrogateescape), so a name
  // that is not valid UTF-8 still round-trips into the exception.
  nb::object filename = nb::steal(PyUnicode_DecodeFSDefaultAndSize(
      e.path().data(), static_cast<Py_ssize_t>(e.path().size())));
  if (!filename.is_valid()) return nullptr;
  return PyObject_CallFunction(PyExc_OSError, "isO", e.error_code(), text.c_str(),
                               filename.ptr());
}

void raise_os_error(const IoError& e) {
  PyObject* exc = make_os_error(e);
  if (exc == nullptr) return;  // the call already set an error
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc)), exc);
  Py_DECREF(exc);
}

// FormatError(message, offset) with its `shard_only` attribute (see FormatError::shard_only).
// Returns a new reference, or null with a Python error set.
PyObject* make_format_error(const FormatError& e) {
  nb::object args = nb::make_tuple(nb::str(e.what()), e.offset());
  PyObject* exc = PyObject_CallObject(g_format_error, args.ptr());
  if (exc != nullptr &&
      PyObject_SetAttrString(exc, "shard_only", e.shard_only() ? Py_True : Py_False) != 0)
    Py_CLEAR(exc);
  return exc;
}

void translate_exceptions(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const IoError& e) {
    raise_os_error(e);
  } catch (const FormatError& e) {
    PyObject* exc = make_format_error(e);
    if (exc == nullptr) return;  // the call already set an error
    PyErr_SetObject(g_format_error, exc);
    Py_DECREF(exc);
  }
}

// Borrowed view of any contiguous buffer-protocol object, released on scope exit.
// Holding the view keeps the exporter alive and, for bytearray and mmap, stops a resize or close.
class BufferView {
 public:
  explicit BufferView(nb::handle obj, bool writable = false) {
    if (PyObject_GetBuffer(obj.ptr(), &view_, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) != 0)
      throw nb::python_error();
  }
  ~BufferView() { PyBuffer_Release(&view_); }
  BufferView(const BufferView&) = delete;
  BufferView& operator=(const BufferView&) = delete;
  const uint8_t* data() const { return static_cast<const uint8_t*>(view_.buf); }
  uint8_t* writable_data() const { return static_cast<uint8_t*>(view_.buf); }
  size_t size() const { return static_cast<size_t>(view_.len); }

 private:
  Py_buffer view_{};
};

using ByteView = nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using U64Array = nb::ndarray<nb::numpy, uint64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// A numpy array owning a copy of `n` values: independent of the C++ object they came from.
U64Array copy_to_numpy(const uint64_t* src, size_t n) {
  std::unique_ptr<uint64_t[]> copy(new uint64_t[n ? n : 1]);
  std::memcpy(copy.get(), src, n * sizeof(uint64_t));
  nb::capsule owner(copy.get(), [](void* p) noexcept { delete[] static_cast<uint64_t*>(p); });
  return U64Array(copy.release(), {n}, owner);
}

U64Array latency_counts(const LatencyHistogram& h) {
  return copy_to_numpy(h.counts(), LatencyHistogram::kBuckets);
}

// Refuses a second call on an object while one is in progress. Such calls release the GIL, so
// another thread could call in meanwhile; `flag` is read and set under the GIL, and cleared by
// the destructor, which runs after the GIL is taken back.
class OneCallAtATime {
 public:
  OneCallAtATime(bool& flag, const char* what) : flag_(flag) {
    if (flag_) throw nb::value_error((std::string("another call on this ") + what +
                                      " is in progress").c_str());
    flag_ = true;
  }
  ~OneCallAtATime() { flag_ = false; }
  OneCallAtATime(const OneCallAtATime&) = delete;
  OneCallAtATime& operator=(const OneCallAtATime&) = delete;

 private:
  bool& flag_;
};

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
    return ::latency_counts(h);
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


// Decodes an extension as the dict path does: the scanner lowercased ASCII; str.lower()
// finishes the job for non-ASCII names, as webdataset's suffix.lower() does.
nb::object decode_extension(const std::string& raw) {
  PyObject* s = PyUnicode_DecodeUTF8(raw.data(), static_cast<Py_ssize_t>(raw.size()),
                                     "surrogateescape");
  if (s == nullptr) throw nb::python_error();
  nb::object ext = nb::steal(s);
  for (unsigned char c : raw)
    if (c >= 0x80) return ext.attr("lower")();
  return ext;
}

nb::object decode_name(const std::string& raw) {  // tarfile's rule: UTF-8, surrogateescape
  PyObject* s = PyUnicode_DecodeUTF8(raw.data(), static_cast<Py_ssize_t>(raw.size()),
                                     "surrogateescape");
  if (s == nullptr) throw nb::python_error();
  return nb::steal(s);
}

using I64Array = nb::ndarray<nb::numpy, int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using I64In = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

I64Array copy_i64(const std::vector<int64_t>& v) {
  std::unique_ptr<int64_t[]> copy(new int64_t[v.empty() ? 1 : v.size()]);
  if (!v.empty()) std::memcpy(copy.get(), v.data(), v.size() * sizeof(int64_t));
  nb::capsule owner(copy.get(), [](void* p) noexcept { delete[] static_cast<int64_t*>(p); });
  return I64Array(copy.release(), {v.size()}, owner);
}

// One batch being packed into a writable buffer (a shared-memory slab); holds the buffer's
// export, so the memory can be neither freed nor resized while the packer lives.
class PyBatchPacker {
 public:
  PyBatchPacker(nb::handle memory, uint64_t base, uint64_t region_bytes,
                const std::vector<std::string>& exts)
      : view_(std::make_unique<BufferView>(memory, /*writable=*/true)) {
    try {
      packer_ = std::make_unique<BatchPacker>(view_->writable_data(), view_->size(), base,
                                              region_bytes, exts);
    } catch (const std::invalid_argument& e) {
      throw nb::value_error(e.what());
    }
  }

  void relocate(nb::handle memory, uint64_t region_bytes) {
    auto view = std::make_unique<BufferView>(memory, /*writable=*/true);
    try {
      packer_->relocate(view->writable_data(), view->size(), region_bytes);
    } catch (const std::invalid_argument& e) {
      throw nb::value_error(e.what());
    }
    view_ = std::move(view);  // releases the old buffer
  }

  size_t count() const { return packer_->count(); }
  uint64_t region_bytes() const { return packer_->region_bytes(); }

  // (keys, offsets, fields): keys as str, the shard offset of each sample's first header, and
  // per field (ext, region offset, bytes used, lengths with -1 for absent).
  nb::tuple result() const {
    nb::list keys;
    for (const std::string& key : packer_->keys()) keys.append(decode_name(key));
    std::vector<int64_t> offsets(packer_->offsets().begin(), packer_->offsets().end());
    nb::list fields;
    for (const PackedField& f : packer_->fields())
      fields.append(nb::make_tuple(decode_extension(f.ext), f.region, f.bytes,
                                   copy_i64(f.lengths)));
    return nb::make_tuple(keys, copy_i64(offsets), fields);
  }

  BatchPacker& packer() { return *packer_; }

 private:
  std::unique_ptr<BufferView> view_;
  std::unique_ptr<BatchPacker> packer_;
};

class PyScanner {
 public:
  PyScanner() : key_key_("__key__"), url_key_("__url__"), local_key_("__local_path__") {}
  PyScanner(const PyScanner&) = delete;
  PyScanner& operator=(const PyScanner&) = delete;

  void begin_shard(nb::object url, nb::object local_path, uint64_t start_offset) {
    OneCallAtATime busy(busy_, "Scanner");
    url_ = std::move(url);
    local_path_ = std::move(local_path);
    scanner_.begin_shard(start_offset);
    release_fed();
  }

  // Emitted samples may point into `data`: its buffer export is held (the object can be neither
  // freed nor resized: a bytearray refuses with BufferError) until they are all taken.
  void feed(nb::handle data) {
    OneCallAtATime busy(busy_, "Scanner");
    auto view = std::make_unique<BufferView>(data);
    try {
      nb::gil_scoped_release release;
      scanner_.feed(view->data(), view->size());
    } catch (...) {  // samples completed before the error may point into `data` too
      if (!scanner_.samples().empty()) fed_.push_back(std::move(view));
      throw;
    }
    if (!scanner_.samples().empty()) fed_.push_back(std::move(view));
  }

  void end_shard() {
    OneCallAtATime busy(busy_, "Scanner");
    nb::gil_scoped_release release;
    scanner_.end_shard();
  }

  // After feed() or end_shard() raised FormatError: the group of members being assembled
  // joins the completed samples (see TarScanner::flush_open_group); false when there is none.
  bool flush_open_group() {
    OneCallAtATime busy(busy_, "Scanner");
    return scanner_.flush_open_group();
  }

  bool at_end() const { return scanner_.at_end(); }

  // The completed samples as webdataset-style dicts, in order; with_offsets also returns the
  // shard offset of each sample's first header (the resume position).
  nb::object take(bool with_offsets) {
    OneCallAtATime busy(busy_, "Scanner");
    std::vector<Sample>& samples = scanner_.samples();
    nb::list out;
    nb::list offsets;
    size_t taken = 0;
    for (; taken < samples.size(); ++taken) {
      const Sample& sample = samples[taken];
      nb::dict d;
      try {
        d = to_dict(sample);
      } catch (const FormatError&) {
        if (taken == 0) throw;
        break;  // the samples before it now; it raises on the next take()
      }
      out.append(d);
      if (with_offsets) offsets.append(nb::make_tuple(sample.offset, sample.end_offset));
    }
    if (taken == samples.size()) {
      scanner_.clear_samples();
      release_fed();
    } else {
      samples.erase(samples.begin(), samples.begin() + static_cast<std::ptrdiff_t>(taken));
    }
    if (with_offsets) return nb::make_tuple(out, offsets);
    return out;
  }


  // Shard offsets (first header, end) of the completed samples not taken yet, as two int64
  // arrays; the samples stay in the scanner for take() or pack().
  nb::tuple spans() {
    OneCallAtATime busy(busy_, "Scanner");
    const std::vector<Sample>& samples = scanner_.samples();
    std::vector<int64_t> starts(samples.size()), ends(samples.size());
    for (size_t i = 0; i < samples.size(); ++i) {
      starts[i] = static_cast<int64_t>(samples[i].offset);
      ends[i] = static_cast<int64_t>(samples[i].end_offset);
    }
    return nb::make_tuple(copy_i64(starts), copy_i64(ends));
  }

  // Copies completed sample i into packers[targets[i]] (targets[i] < 0: dropped), from sample
  // `start` on. Returns -1 once every sample is placed (the samples are then taken), or the
  // index of a sample its packer has no region for (nothing taken: relocate that packer and
  // call again from there).
  int64_t pack(I64In targets, nb::list packers, size_t start) {
    OneCallAtATime busy(busy_, "Scanner");
    std::vector<Sample>& samples = scanner_.samples();
    if (targets.shape(0) != samples.size())
      throw nb::value_error("pack: need one target per completed sample");
    std::vector<BatchPacker*> list;
    for (nb::handle p : packers) list.push_back(&nb::cast<PyBatchPacker&>(p).packer());
    const int64_t* t = targets.data();
    for (size_t i = 0; i < samples.size(); ++i)
      if (t[i] >= static_cast<int64_t>(list.size()))
        throw nb::value_error("pack: a target names no packer");
    int64_t refused = -1;
    try {
      nb::gil_scoped_release release;
      for (size_t i = start; i < samples.size(); ++i) {
        if (t[i] < 0) continue;
        if (list[t[i]]->add(samples[i]) == BatchPacker::Status::kNoRegion) {
          refused = static_cast<int64_t>(i);
          break;
        }
      }
    } catch (const std::length_error& e) {
      throw nb::value_error(e.what());
    }
    if (refused < 0) {
      scanner_.clear_samples();
      release_fed();
    }
    return refused;
  }

  nb::dict stats() const {
    const ScanStats& s = scanner_.stats();
    nb::dict d;
    d["members"] = s.members;
    d["skipped"] = s.skipped;
    d["samples"] = s.samples;
    d["bytes"] = s.bytes;
    return d;
  }

 private:
  // Key order matches webdataset's group_by_keys: __key__, __url__, first field,
  // __local_path__, further fields.
  nb::dict to_dict(const Sample& sample) {
    nb::dict d;
    d[key_key_] = decode(sample.key);
    d[url_key_] = url_;
    bool first = true;
    for (const Field& field : sample.fields) {
      nb::object value = nb::steal(PyBytes_FromStringAndSize(
          reinterpret_cast<const char*>(field.data), static_cast<Py_ssize_t>(field.size)));
      if (!value.is_valid()) throw nb::python_error();
      const Extension& ext = extension(field.ext);
      if (ext.check && (d.contains(ext.name) || ext.name.equal(local_key_)))
        throw FormatError("duplicate file name in tar file: " + sample.key + "." + field.ext +
                              " (extension " + nb::cast<std::string>(nb::repr(ext.name)) +
                              " once lowercased)",
                          sample.offset);
      d[ext.name] = value;
      if (first && !local_path_.is_none()) d[local_key_] = local_path_;
      first = false;
    }
    return d;
  }

  static nb::object decode(const std::string& raw) { return decode_name(raw); }

  // A field's name, decoded once per distinct extension (they repeat on every sample).
  // `check`: the scanner's duplicate test does not cover this name, so the dict must. The
  // scanner compares ASCII-lowercased bytes and refuses "__key__" and "__url__"; str.lower()
  // (webdataset's rule) folds non-ASCII further ("\u212a" is "k"), and "__local_path__" is
  // ours to add. Two members must never become one field, nor a member replace a key of ours.
  struct Extension {
    nb::object name;
    bool check;
  };

  const Extension& extension(const std::string& raw) {
    auto it = ext_cache_.find(raw);
    if (it != ext_cache_.end()) return it->second;
    nb::object s = decode_extension(raw);
    PyObject* raw_str = s.release().ptr();
    PyUnicode_InternInPlace(&raw_str);
    s = nb::steal(raw_str);
    const bool ascii = std::all_of(raw.begin(), raw.end(),
                                   [](char c) { return static_cast<unsigned char>(c) < 0x80; });
    const bool check = !ascii || s.equal(local_key_);
    return ext_cache_.emplace(raw, Extension{s, check}).first->second;
  }

  TarScanner scanner_;
  nb::str key_key_, url_key_, local_key_;
  // Once no sample is left, no sample points into a fed buffer.
  void release_fed() {
    if (scanner_.samples().empty()) fed_.clear();
  }

  nb::object url_ = nb::none(), local_path_ = nb::none();
  std::vector<std::unique_ptr<BufferView>> fed_;  // exports of the buffers samples point into
  bool busy_ = false;  // scanning could change the samples or free a fed buffer under a call
  std::unordered_map<std::string, Extension> ext_cache_;
};

nb::object split_key_py(nb::bytes name) {
  std::string_view key, ext;
  if (!split_key(std::string_view(name.c_str(), name.size()), &key, &ext)) return nb::none();
  return nb::make_tuple(nb::bytes(key.data(), key.size()), nb::bytes(ext.data(), ext.size()));
}

// Lower bound (ns) of every latency histogram bucket; bucket i is [b[i], b[i+1]), and the last
// has the width of the one before it.
// The keys LatencyHistogram.from_core reads: counts, min_ns, max_ns, sum_ns.
void put_histogram(nb::dict& d, const LatencyHistogram& h) {
  d["counts"] = latency_counts(h);
  d["min_ns"] = h.min();
  d["max_ns"] = h.max();
  d["sum_ns"] = h.sum();
}

U64Array histogram_bounds() {
  std::vector<uint64_t> bounds(LatencyHistogram::kBuckets);
  for (size_t i = 0; i < bounds.size(); ++i) bounds[i] = LatencyHistogram::bucket_lower(i);
  return copy_to_numpy(bounds.data(), bounds.size());
}

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

nb::dict run_probe_py(const std::string& path, const std::string& op, const std::string& pattern,
                      size_t block_size, unsigned queue_depth, uint64_t bytes, double duration,
                      const std::string& engine, bool direct, uint64_t seed, double interval) {
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

// ---- checkpoint I/O: checksums, pacing, whole-file writes and reads ----

constexpr size_t kReleaseGilAbove = 64 * 1024;  // checksumming less is quicker than the handoff

uint32_t crc32c_py(nb::handle data, uint32_t crc) {
  BufferView view(data);
  if (view.size() <= kReleaseGilAbove) return crc32c(view.data(), view.size(), crc);
  nb::gil_scoped_release release;
  return crc32c(view.data(), view.size(), crc);
}

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

// ---- copies ----

// triples: (src, dst, len) flattened into one uint64 array (cheap to build for 50,000 tensors).
void copy_ranges_py(U64Array triples, unsigned threads) {
  const size_t n = triples.shape(0);
  if (n % 3) throw std::invalid_argument("copy_ranges takes (src, dst, len) triples");
  std::vector<CopyRange> jobs(n / 3);
  const uint64_t* v = triples.data();
  for (size_t i = 0; i < jobs.size(); ++i)
    jobs[i] = {reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(v[3 * i])),
               reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(v[3 * i + 1])),
               static_cast<size_t>(v[3 * i + 2])};
  nb::gil_scoped_release release;
  copy_ranges(jobs.data(), jobs.size(), threads);
}

// ---- copy-on-write snapshot ----

// A CowSnapshot driven from Python. The ranges are raw addresses: the caller keeps the tensors
// and the staging buffer alive until wait() returns (flashstream.engine.cow_snapshot does).
// A fork() child's copy has none of the snapshot's threads: there every call raises and the
// destructor leaks it rather than join them (see common/owner_process.hpp).
class PyCowSnapshot {
 public:
  ~PyCowSnapshot() {
    if (!owner_.here()) (void)snap_.release();
  }

  PyCowSnapshot(const std::vector<std::tuple<uint64_t, uint64_t, uint64_t>>& ranges,
                size_t block, bool allow_user_mode_only) {
    std::vector<CopyRange> list;
    list.reserve(ranges.size());
    for (const auto& [src, dst, len] : ranges)
      list.push_back({reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(src)),
                      reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(dst)),
                      static_cast<size_t>(len)});
    nb::gil_scoped_release release;  // copies the eager bytes, protects the rest
    snap_ = std::make_unique<CowSnapshot>(std::move(list), block, allow_user_mode_only);
  }

  void wait() {
    owner_.check("this snapshot");
    nb::gil_scoped_release release;
    snap_->wait();
  }

  bool done() const {
    owner_.check("this snapshot");
    return snap_->done();
  }

  nb::dict stats() const {
    owner_.check("this snapshot");
    const CowStats s = snap_->stats();
    nb::dict d;
    d["protected_bytes"] = s.protected_bytes;
    d["eager_bytes"] = s.eager_bytes;
    d["fault_copies"] = s.fault_copies;
    d["fault_bytes"] = s.fault_bytes;
    d["background_bytes"] = s.background_bytes;
    d["protect_seconds"] = s.protect_seconds;
    d["eager_seconds"] = s.eager_seconds;
    d["copy_seconds"] = s.copy_seconds;
    d["lost_bytes"] = s.lost_bytes;
    return d;
  }

  std::vector<std::pair<uint64_t, uint64_t>> lost() const {
    owner_.check("this snapshot");
    std::vector<std::pair<uint64_t, uint64_t>> out;
    for (const auto& [dst, len] : snap_->lost())
      out.emplace_back(static_cast<uint64_t>(reinterpret_cast<uintptr_t>(dst)), len);
    return out;
  }

 private:
  OwnerProcess owner_;
  std::unique_ptr<CowSnapshot> snap_;
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

NB_MODULE(_core, m) {
  m.doc() = "flashstream C++ core: O_DIRECT reader, tar scanner, checkpoint writer";
  g_format_error = PyErr_NewExceptionWithDoc(
      "flashstream._core.FormatError",
      "A tar shard is malformed; args = (message, offset). shard_only: webdataset, meeting "
      "the same damage, could end only this shard (see csrc/common/errors.hpp).",
      PyExc_ValueError, nullptr);
  m.attr("FormatError") = nb::borrow(g_format_error);
  nb::register_exception_translator(translate_exceptions);

  m.def("uring_available", &uring_available,
        "True when this process can create an io_uring instance.");
  m.def("split_key", &split_key_py, nb::arg("name"),
        "webdataset's base_plus_ext on raw bytes: (key, ext) or None.");
  m.def("is_meta_name", [](nb::bytes name) {
    return is_meta_name(std::string_view(name.c_str(), name.size()));
  });

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

  m.def("histogram_bounds", &histogram_bounds,
        "Lower bound in ns of each latency histogram bucket (uint64 array, one per count).");
  m.def("run_probe", &run_probe_py, nb::arg("path"), nb::arg("op") = "read",
        nb::arg("pattern") = "sequential", nb::arg("block_size") = size_t(1) << 20,
        nb::arg("queue_depth") = 32u, nb::arg("bytes") = uint64_t(0), nb::arg("duration") = 0.0,
        nb::arg("engine") = "auto", nb::arg("direct") = true, nb::arg("seed") = uint64_t(0),
        nb::arg("interval") = 0.0,
        "Measure the device like fio: queue_depth requests of block_size in flight on an "
        "existing file. Returns a dict (bytes, seconds, sync_seconds, requests, direct, engine, "
        "counts, min_ns, max_ns, sum_ns, timeline).");
  m.def("index_shards", &index_shards_py, nb::arg("paths"), nb::arg("engine") = "auto",
        nb::arg("queue_depth") = 32u, nb::arg("direct") = true,
        nb::arg("chunk_size") = size_t(1) << 20, nb::arg("hop_read") = size_t(4096),
        nb::arg("hop_threshold") = uint64_t(64) << 10, nb::arg("decide_after") = 8u,
        "Index tar shards (paths as bytes) by hopping from header to header, or reading "
        "sequentially where members are small. Returns ([(outcome, offsets, ends, error, "
        "sequential, hops), ...], stats dict); outcome is indexed, failed, "
        "compressed or full_scan (left to the caller).");
  m.def("create_probe_file", &create_probe_file_py, nb::arg("path"), nb::arg("size"),
        "Create or resize a preallocated file of random data for run_probe.");

  m.def("crc32c", &crc32c_py, nb::arg("data"), nb::arg("crc") = 0u,
        "CRC-32C of a contiguous buffer; pass a previous result as crc to continue it.");
  m.def("crc32c_hardware", &crc32c_hardware, "True when crc32c uses the CPU's CRC instruction.");

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

  m.def("read_file_into", &read_file_into_py, nb::arg("path"), nb::arg("data"),
        nb::arg("length"), nb::arg("chunk_size"), nb::arg("queue_depth"), nb::arg("engine"),
        nb::arg("direct"),
        "Read the file's first `length` bytes into a writable buffer (room for the length "
        "rounded up to the O_DIRECT alignment). Returns a dict (bytes, seconds, requests, "
        "counts, min_ns, max_ns, sum_ns, engine, direct).");

  nb::class_<PyScanner>(m, "Scanner")
      .def(nb::init<>())
      .def("begin_shard", &PyScanner::begin_shard, nb::arg("url"), nb::arg("local_path").none(),
           nb::arg("start_offset") = 0)
      .def("feed", &PyScanner::feed, nb::arg("data"))
      .def("end_shard", &PyScanner::end_shard)
      .def("flush_open_group", &PyScanner::flush_open_group)
      .def_prop_ro("at_end", &PyScanner::at_end)
      .def("take", &PyScanner::take, nb::arg("with_offsets") = false)
      .def("spans", &PyScanner::spans)
      .def("pack", &PyScanner::pack, nb::arg("targets"), nb::arg("packers"),
           nb::arg("start") = 0)
      .def("stats", &PyScanner::stats);
  nb::class_<PyBatchPacker>(m, "BatchPacker")
      .def(nb::init<nb::handle, uint64_t, uint64_t, const std::vector<std::string>&>(),
           nb::arg("memory"), nb::arg("base"), nb::arg("region_bytes"), nb::arg("exts"),
           "A batch packed into a writable buffer: region k (of region_bytes) at base + k * "
           "region_bytes holds the k-th extension's payloads, in the order samples arrive.")
      .def("relocate", &PyBatchPacker::relocate, nb::arg("memory"), nb::arg("region_bytes"))
      .def_prop_ro("count", &PyBatchPacker::count)
      .def_prop_ro("region_bytes", &PyBatchPacker::region_bytes)
      .def("result", &PyBatchPacker::result);
  m.def("copy_ranges", &copy_ranges_py, nb::arg("triples"), nb::arg("threads") = 1u,
        "Copy (src, dst, len) triples (a flat uint64 array of raw addresses) on `threads` "
        "threads, GIL released. The caller keeps the memory alive; no overlap within a copy.");
  m.def("cow_available", &cow_available,
        "True when userfaultfd can write-protect memory here, kernel writes included.");
  m.def("cow_mode", [] { return std::string(cow_mode_name(cow_mode())); },
        "'full' (kernel writes fault too), 'user' (UFFD_USER_MODE_ONLY only) or 'none'.");
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
  nb::class_<PyCowSnapshot>(m, "CowSnapshot",
                            "Copy-on-write snapshot of raw memory ranges (see "
                            "csrc/snapshot/cow_snapshot.hpp).")
      .def(nb::init<const std::vector<std::tuple<uint64_t, uint64_t, uint64_t>>&, size_t, bool>(),
           nb::arg("ranges"), nb::arg("block") = size_t(2) << 20,
           nb::arg("allow_user_mode_only") = false,
           "ranges: [(src_ptr, dst_ptr, len)]. Returns once every byte is copied or "
           "write-protected (GIL released).")
      .def("wait", &PyCowSnapshot::wait,
           "Until every byte is copied and nothing is protected (GIL released).")
      .def("done", &PyCowSnapshot::done)
      .def("stats", &PyCowSnapshot::stats,
           "dict: protected_bytes, eager_bytes, fault_copies, fault_bytes, background_bytes, "
           "protect_seconds, eager_seconds, copy_seconds, lost_bytes.")
      .def("lost", &PyCowSnapshot::lost,
           "After wait(): [(dst_ptr, len)] destination bytes that do not hold the snapshot "
           "because their source memory was released (freed, resized, unmapped) before it "
           "was copied. Empty when the snapshot is whole.");
}
