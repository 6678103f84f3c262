// Snapshots (csrc/snapshot/): copy_ranges, and CowSnapshot with its availability checks.
#include "bindings/bindings.hpp"

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/owner_process.hpp"
#include "snapshot/copy_ranges.hpp"
#include "snapshot/cow_snapshot.hpp"

namespace flashstream::bindings {
namespace {

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

}  // namespace

void bind_snapshot(nb::module_& m) {
  m.def("copy_ranges", &copy_ranges_py, nb::arg("triples"), nb::arg("threads") = 1u,
        "Copy (src, dst, len) triples (a flat uint64 array of raw addresses) on `threads` "
        "threads, GIL released. The caller keeps the memory alive; no overlap within a copy.");
  m.def("cow_available", &cow_available,
        "True when userfaultfd can write-protect memory here, kernel writes included.");
  m.def("cow_mode", [] { return std::string(cow_mode_name(cow_mode())); },
        "'full' (kernel writes fault too), 'user' (UFFD_USER_MODE_ONLY only) or 'none'.");
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

}  // namespace flashstream::bindings
