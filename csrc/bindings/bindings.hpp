// The bindings' shared internal header: what the files of csrc/bindings/ share, and the one
// bind_<area>() function each defines for module.cpp to call.
//
// Rule: Python (and nanobind) headers appear only under csrc/bindings/. The core below
// (common/, io/, tar/, index/, telemetry/, probe/, snapshot/) never includes them, so it builds,
// is tested and is fuzzed without Python; these files convert arguments, release the GIL around
// I/O and scanning, and map C++ errors to Python exceptions. Only flashstream/engine.py imports
// the module they make (flashstream._core).
#pragma once

// Every binding file sees the same type casters: a file that lacked one (stl/vector.h, say)
// would still compile but treat std::vector as an unregistered class, and fail at call time.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/errors.hpp"
#include "telemetry/histogram.hpp"

namespace nb = nanobind;

namespace flashstream::bindings {

// One per area, called once each by NB_MODULE (module.cpp).
void bind_common(nb::module_& m);     // common.cpp: FormatError, error mapping, CRC-32C
void bind_io(nb::module_& m);         // io.cpp: engines, Reader, RangeFile
void bind_bulk_io(nb::module_& m);    // bulk_io.cpp: pacing, OutputFile, read_file_into
void bind_tar(nb::module_& m);        // tar.cpp: Scanner, BatchPacker, member names
void bind_index(nb::module_& m);      // index.cpp: index_shards
void bind_telemetry(nb::module_& m);  // telemetry.cpp: histograms, clock, the device probe
void bind_snapshot(nb::module_& m);   // snapshot.cpp: copy_ranges, CowSnapshot

// ---- errors (common.cpp) ----

// OSError(errno, strerror, filename): the subclass (FileNotFoundError, ...) follows errno.
// Returns a new reference, or null with a Python error set.
PyObject* make_os_error(const IoError& e);

// FormatError(message, offset) with its `shard_only` attribute (see FormatError::shard_only).
// Returns a new reference, or null with a Python error set.
PyObject* make_format_error(const FormatError& e);

// ---- arrays ----

using U64Array = nb::ndarray<nb::numpy, uint64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using I64Array = nb::ndarray<nb::numpy, int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// A numpy array owning a copy of `v` (common.cpp).
I64Array copy_i64(const std::vector<int64_t>& v);

// ---- latency histograms (telemetry.cpp) ----

// Copy of the histogram's counts, one per bucket of histogram_bounds().
U64Array latency_counts(const LatencyHistogram& h);

// The keys LatencyHistogram.from_core reads: counts, min_ns, max_ns, sum_ns.
void put_histogram(nb::dict& d, const LatencyHistogram& h);

// ---- buffers and calls ----

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

}  // namespace flashstream::bindings
