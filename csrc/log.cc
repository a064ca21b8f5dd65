#include "log.h"

#include <atomic>

namespace kvio {

RateLimitedLog::RateLimitedLog(unsigned burst, Clock::duration window, size_t capacity)
    : burst_(burst), window_(window), capacity_(capacity) {}

void RateLimitedLog::push(int level, std::string message) {
  if (queue_.size() >= capacity_) {
    ++dropped_;
    return;
  }
  queue_.push_back({level, std::move(message)});
}

void RateLimitedLog::add(int level, const std::string& key, std::string message,
                         Clock::time_point now) {
  std::lock_guard<std::mutex> l(mu_);
  Source& s = sources_[key];
  if (s.in_window == 0 || now - s.window_start >= window_) {
    if (s.suppressed) {
      push(kLogWarning, std::to_string(s.suppressed) + " similar messages suppressed (" + key +
                            ")");
      s.suppressed = 0;
    }
    s.window_start = now;
    s.in_window = 0;
  }
  if (s.in_window >= burst_) {
    ++s.suppressed;
    return;
  }
  ++s.in_window;
  push(level, std::move(message));
}

std::vector<LogRecord> RateLimitedLog::drain() {
  std::lock_guard<std::mutex> l(mu_);
  std::vector<LogRecord> out;
  out.swap(queue_);
  if (dropped_) {
    out.push_back({kLogWarning, std::to_string(dropped_) + " engine log messages dropped "
                                                           "(queue full)"});
    dropped_ = 0;
  }
  return out;
}

bool RateLimitedLog::pending() const {
  std::lock_guard<std::mutex> l(mu_);
  return !queue_.empty() || dropped_ != 0;
}

namespace {
RateLimitedLog& global_log() {
  static RateLimitedLog* log = new RateLimitedLog(5, std::chrono::seconds(10), 256);  // never freed:
  return *log;  // SPDK threads may log during process exit
}
std::atomic<bool> g_pending{false};
}  // namespace

void engine_log(int level, const std::string& key, std::string message) {
  global_log().add(level, key, std::move(message), RateLimitedLog::Clock::now());
  g_pending.store(true, std::memory_order_release);
}

std::vector<LogRecord> drain_engine_log() {
  g_pending.store(false, std::memory_order_release);
  return global_log().drain();
}

bool engine_log_pending() { return g_pending.load(std::memory_order_acquire); }

}  // namespace kvio
