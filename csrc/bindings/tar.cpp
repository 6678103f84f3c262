// Tar scanning (csrc/tar/): member names (split_key, is_meta_name), Scanner, which turns fed
// bytes into webdataset's sample dicts, and BatchPacker, which packs samples into a slab.
#include "bindings/bindings.hpp"

#include <algorithm>
#include <cstddef>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/errors.hpp"
#include "tar/batch_packer.hpp"
#include "tar/tar_scanner.hpp"

namespace flashstream::bindings {
namespace {

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

using I64In = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

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

}  // namespace

void bind_tar(nb::module_& m) {
  m.def("split_key", &split_key_py, nb::arg("name"),
        "webdataset's base_plus_ext on raw bytes: (key, ext) or None.");
  m.def("is_meta_name", [](nb::bytes name) {
    return is_meta_name(std::string_view(name.c_str(), name.size()));
  });

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
}

}  // namespace flashstream::bindings
