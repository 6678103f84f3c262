// flashstream._core: the one NB_MODULE. Each area's classes and functions are bound by its own
// file in this folder (see bindings.hpp); only flashstream/engine.py imports this module.
#include "bindings/bindings.hpp"

NB_MODULE(_core, m) {
  using namespace flashstream::bindings;
  m.doc() = "flashstream C++ core: O_DIRECT reader, tar scanner, checkpoint writer";
  bind_common(m);  // first: FormatError and the exception translator
  bind_io(m);
  bind_tar(m);
  bind_telemetry(m);
  bind_index(m);
  bind_bulk_io(m);
  bind_snapshot(m);
}
