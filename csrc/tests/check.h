// The C++ tests' one assertion: a failed CHECK is reported and counted, the test goes on;
// finish() turns the count into the exit status.
#pragma once

#include <cstdio>

static int g_failures = 0;

#define CHECK(cond)                                                                  \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++g_failures;                                                                  \
    }                                                                                \
  } while (0)

static inline int finish(const char* suite) {
  if (g_failures) {
    std::fprintf(stderr, "%d check(s) failed\n", g_failures);
    return 1;
  }
  std::printf("%s passed\n", suite);
  return 0;
}
