// Errors and checksums (csrc/common/): FormatError and the exception translator that maps the
// core's IoError and FormatError to Python, CRC-32C, and the array copies other files share.
#include "bindings/bindings.hpp"

#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "common/crc32c.hpp"
#include "common/errors.hpp"

namespace flashstream::bindings {
namespace {

PyObject* g_format_error = nullptr;  // flashstream._core.FormatError (a ValueError)

}  // namespace

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

PyObject* make_format_error(const FormatError& e) {
  nb::object args = nb::make_tuple(nb::str(e.what()), e.offset());
  PyObject* exc = PyObject_CallObject(g_format_error, args.ptr());
  if (exc != nullptr &&
      PyObject_SetAttrString(exc, "shard_only", e.shard_only() ? Py_True : Py_False) != 0)
    Py_CLEAR(exc);
  return exc;
}

I64Array copy_i64(const std::vector<int64_t>& v) {
  std::unique_ptr<int64_t[]> copy(new int64_t[v.empty() ? 1 : v.size()]);
  if (!v.empty()) std::memcpy(copy.get(), v.data(), v.size() * sizeof(int64_t));
  nb::capsule owner(copy.get(), [](void* p) noexcept { delete[] static_cast<int64_t*>(p); });
  return I64Array(copy.release(), {v.size()}, owner);
}

namespace {

void raise_os_error(const IoError& e) {
  PyObject* exc = make_os_error(e);
  if (exc == nullptr) return;  // the call already set an error
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc)), exc);
  Py_DECREF(exc);
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

constexpr size_t kReleaseGilAbove = 64 * 1024;  // checksumming less is quicker than the handoff

uint32_t crc32c_py(nb::handle data, uint32_t crc) {
  BufferView view(data);
  if (view.size() <= kReleaseGilAbove) return crc32c(view.data(), view.size(), crc);
  nb::gil_scoped_release release;
  return crc32c(view.data(), view.size(), crc);
}

}  // namespace

void bind_common(nb::module_& m) {
  g_format_error = PyErr_NewExceptionWithDoc(
      "flashstream._core.FormatError",
      "A tar shard is malformed; args = (message, offset). shard_only: webdataset, meeting "
      "the same damage, could end only this shard (see csrc/common/errors.hpp).",
      PyExc_ValueError, nullptr);
  m.attr("FormatError") = nb::borrow(g_format_error);
  nb::register_exception_translator(translate_exceptions);

  m.def("crc32c", &crc32c_py, nb::arg("data"), nb::arg("crc") = 0u,
        "CRC-32C of a contiguous buffer; pass a previous result as crc to continue it.");
  m.def("crc32c_hardware", &crc32c_hardware, "True when crc32c uses the CPU's CRC instruction.");
}

}  // namespace flashstream::bindings
