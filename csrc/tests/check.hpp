// A minimal test harness for the C++ unit tests (no framework dependency): CHECK records a
// failure with file and line and the test binary exits non-zero if any check failed.
#pragma once

#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace fstest {

inline int& failures() {
  static int n = 0;
  return n;
}

struct Case {
  const char* name;
  std::function<void()> fn;
};

inline std::vector<Case>& cases() {
  static std::vector<Case> v;
  return v;
}

struct Register {
  Register(const char* name, std::function<void()> fn) { cases().push_back({name, std::move(fn)}); }
};

inline int run_all() {
  for (auto& c : cases()) {
    int before = failures();
    try {
      c.fn();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "  unexpected exception: %s\n", e.what());
      ++failures();
    }
    std::printf("%s %s\n", failures() == before ? "PASS" : "FAIL", c.name);
  }
  std::printf("%d failed\n", failures());
  return failures() ? 1 : 0;
}

}  // namespace fstest

#define FS_CONCAT2(a, b) a##b
#define FS_CONCAT(a, b) FS_CONCAT2(a, b)
#define TEST_CASE(name)                                              \
  static void FS_CONCAT(test_fn_, __LINE__)();                       \
  static fstest::Register FS_CONCAT(test_reg_, __LINE__)(name, FS_CONCAT(test_fn_, __LINE__)); \
  static void FS_CONCAT(test_fn_, __LINE__)()

#define CHECK(cond)                                                              \
  do {                                                                           \
    if (!(cond)) {                                                               \
      std::fprintf(stderr, "  %s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++fstest::failures();                                                      \
    }                                                                            \
  } while (0)

#define CHECK_THROWS(expr, type)                                                 \
  do {                                                                           \
    bool thrown_ = false;                                                        \
    try { expr; } catch (const type&) { thrown_ = true; }                        \
    if (!thrown_) {                                                              \
      std::fprintf(stderr, "  %s:%d: expected %s from %s\n", __FILE__, __LINE__, #type, #expr); \
      ++fstest::failures();                                                      \
    }                                                                            \
  } while (0)

#define TEST_MAIN() int main() { return fstest::run_all(); }
