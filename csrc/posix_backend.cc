// POSIX backend: pread/pwrite on a small thread pool per device. For filesystems without
// O_DIRECT (tmpfs) and as the portable fallback.
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "backend.h"
#include "common.h"

namespace kvio {
namespace {

class PosixBackend final : public Backend {
 public:
  explicit PosixBackend(const BackendOptions& o) : opts_(o) {
    unsigned n = o.threads ? o.threads : std::min(o.queue_depth ? o.queue_depth : 32u, 8u);
    for (unsigned i = 0; i < n; ++i) workers_.emplace_back([this] { work(); });
  }
  ~PosixBackend() override { shutdown(); }

  const char* name() const override { return "posix"; }
  uint64_t inflight() const override { return outstanding_.load(); }

  void submit(const std::vector<Request*>& reqs) override {
    {
      std::lock_guard<std::mutex> l(mu_);
      for (Request* r : reqs) queue_.push_back(r);
      outstanding_ += reqs.size();
    }
    cv_.notify_all();
  }

  // pread/pwrite need no registration.
  void register_regions(const std::vector<Region>&) override {}

  void shutdown() override {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    std::lock_guard<std::mutex> j(join_mu_);
    for (auto& t : workers_) {
      if (t.joinable()) t.join();
    }
  }

 private:
  // Moves the request's bytes; returns (errno, message) for its completion.
  std::pair<int, std::string> transfer(Request* r) const {
    while (r->done < r->length) {
      auto* buf = reinterpret_cast<char*>(r->addr + r->done);
      const size_t len = r->length - r->done;
      const off_t off = static_cast<off_t>(r->offset + r->done);
      const ssize_t n = r->write ? pwrite(opts_.fd, buf, len, off) : pread(opts_.fd, buf, len, off);
      if (n < 0) {
        if (errno == EINTR || errno == EAGAIN) continue;
        return {errno, ""};
      }
      if (n == 0) {
        return {r->write ? ENOSPC : EIO,
                std::string("short ") + (r->write ? "write" : "read") + ": " +
                    std::to_string(r->done) + " of " + std::to_string(r->length) +
                    " bytes transferred (device ended)"};
      }
      r->done += static_cast<uint64_t>(n);
    }
    return {0, ""};
  }

  void work() {
    for (;;) {
      Request* r;
      {
        std::unique_lock<std::mutex> l(mu_);
        cv_.wait(l, [this] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stop_ and drained
        r = queue_.front();
        queue_.pop_front();
      }
      auto [err, message] = transfer(r);
      // Not in flight any more before the waiter wakes: stats() right after wait() reads 0.
      --outstanding_;
      opts_.complete(r, err, message);
    }
  }

  BackendOptions opts_;
  std::mutex mu_, join_mu_;
  std::condition_variable cv_;
  std::deque<Request*> queue_;
  std::atomic<uint64_t> outstanding_{0};
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace

std::unique_ptr<Backend> make_posix_backend(const BackendOptions& opts) {
  return std::make_unique<PosixBackend>(opts);
}

}  // namespace kvio
