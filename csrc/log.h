// Engine log: messages from threads that must not take the GIL (SPDK's log callback, pollers),
// rate-limited per source and queued; bindings.cc drains them into Python logging
// (logger "vllm_kvpool.kvio") on the next call into the engine.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace kvio {

// Python logging levels.
constexpr int kLogDebug = 10, kLogInfo = 20, kLogWarning = 30, kLogError = 40;

struct LogRecord {
  int level;
  std::string message;
};

// At most `burst` messages per `key` (e.g. "nvme_qpair.c:650") in each `window`; the rest are
// counted and reported as one "N similar messages suppressed" record when the key next logs.
// The queue holds at most `capacity` records; overflow is counted and reported the same way.
class RateLimitedLog {
 public:
  using Clock = std::chrono::steady_clock;
  RateLimitedLog(unsigned burst, Clock::duration window, size_t capacity);
  void add(int level, const std::string& key, std::string message, Clock::time_point now);
  std::vector<LogRecord> drain();
  bool pending() const;

 private:
  struct Source {
    Clock::time_point window_start{};
    unsigned in_window = 0;
    uint64_t suppressed = 0;
  };
  void push(int level, std::string message);

  const unsigned burst_;
  const Clock::duration window_;
  const size_t capacity_;
  mutable std::mutex mu_;
  std::map<std::string, Source> sources_;
  std::vector<LogRecord> queue_;
  uint64_t dropped_ = 0;
};

// The process-wide engine log (5 messages per source per 10 s, 256 queued).
void engine_log(int level, const std::string& key, std::string message);
std::vector<LogRecord> drain_engine_log();
bool engine_log_pending();

}  // namespace kvio
