// io_uring backend: one ring and one reaper thread per device, O_DIRECT, registered file and
// registered buffers (the host pools), up to queue_depth requests in flight, optional SQPOLL.
#include <liburing.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <future>
#include <mutex>
#include <thread>

#include "backend.h"
#include "common.h"

namespace kvio {
namespace {

constexpr uint64_t kWakeTag = 0;         // user_data of the eventfd poll
constexpr uint64_t kMaxFixedBuf = 1ull << 30;  // the kernel caps one registered buffer at 1 GiB

struct FixedBuf {
  uint64_t addr, length;
  int index;
};

class UringBackend final : public Backend {
 public:
  explicit UringBackend(const BackendOptions& o) : opts_(o), qd_(o.queue_depth ? o.queue_depth : 32) {
    efd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (efd_ < 0) throw_errno(o.device, "eventfd", -1, 0, errno);
    io_uring_params p{};
    int rc = -EINVAL;
    if (o.sqpoll) {
      p.flags = IORING_SETUP_SQPOLL;
      p.sq_thread_idle = 50;  // ms before the kernel poller sleeps
      rc = io_uring_queue_init_params(qd_ + 1, &ring_, &p);
      if (rc == 0) {
        sqpoll_ = true;
      } else {
        note_ = "SQPOLL unavailable (" + errno_text(-rc) + "), using a normal ring";
        p = io_uring_params{};
      }
    }
    if (!sqpoll_) rc = io_uring_queue_init_params(qd_ + 1, &ring_, &p);
    if (rc < 0) {
      close(efd_);
      throw_errno(o.device, "io_uring_queue_init", -1, 0, -rc);
    }
    int fd = o.fd;
    rc = io_uring_register_files(&ring_, &fd, 1);
    if (rc == 0) {
      fixed_file_ = true;
    } else {
      add_note("registered file unavailable (" + errno_text(-rc) + ")");
    }
    thread_ = std::thread([this] { loop(); });
  }

  ~UringBackend() override {
    shutdown();
    io_uring_queue_exit(&ring_);
    close(efd_);
  }

  const char* name() const override { return "uring"; }
  bool sqpoll() const override { return sqpoll_; }
  uint64_t inflight() const override { return inflight_.load() + queued_.load(); }
  std::string note() const override {
    std::lock_guard<std::mutex> l(mu_);
    return note_;
  }

  void submit(const std::vector<Request*>& reqs) override {
    {
      std::lock_guard<std::mutex> l(mu_);
      for (Request* r : reqs) pending_.push_back(r);
      queued_ += reqs.size();
    }
    wake();
  }

  void register_regions(const std::vector<Region>& regions) override {
    auto task = std::make_shared<std::packaged_task<void()>>([this, regions] { do_register(regions); });
    auto fut = task->get_future();
    {
      std::lock_guard<std::mutex> l(mu_);
      if (stopped_) return;
      controls_.push_back([task] { (*task)(); });
    }
    wake();
    fut.get();  // rethrows registration errors in the caller
  }

  void shutdown() override {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    wake();
    std::lock_guard<std::mutex> j(join_mu_);
    if (thread_.joinable()) thread_.join();
  }

 private:
  void add_note(const std::string& s) {
    if (!note_.empty()) note_ += "; ";
    note_ += s;
  }

  void wake() {
    uint64_t one = 1;
    ssize_t n = write(efd_, &one, sizeof(one));
    (void)n;  // EAGAIN only when the counter is saturated: the thread is awake anyway
  }

  void arm_wake() {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    io_uring_prep_poll_add(sqe, efd_, POLLIN);
    io_uring_sqe_set_data64(sqe, kWakeTag);
  }

  // Runs on the ring thread with nothing in flight.
  void do_register(const std::vector<Region>& regions) {
    if (!fixed_.empty()) {
      io_uring_unregister_buffers(&ring_);
      fixed_.clear();
    }
    std::vector<iovec> iov;
    for (const Region& r : regions) {
      for (uint64_t off = 0; off < r.length; off += kMaxFixedBuf) {
        const uint64_t len = std::min(kMaxFixedBuf, r.length - off);
        iov.push_back({reinterpret_cast<void*>(r.addr + off), static_cast<size_t>(len)});
      }
    }
    if (iov.empty()) return;
    const int rc = io_uring_register_buffers(&ring_, iov.data(), iov.size());
    std::lock_guard<std::mutex> l(mu_);
    if (rc < 0) {
      add_note("registered buffers unavailable (" + errno_text(-rc) + "), using unregistered I/O");
      return;
    }
    for (size_t i = 0; i < iov.size(); ++i) {
      fixed_.push_back({reinterpret_cast<uint64_t>(iov[i].iov_base), iov[i].iov_len,
                        static_cast<int>(i)});
    }
  }

  int fixed_index(uint64_t addr, uint64_t len) const {
    for (const FixedBuf& b : fixed_) {
      if (addr >= b.addr && addr + len <= b.addr + b.length) return b.index;
    }
    return -1;
  }

  void prep(Request* r) {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    const int fd = fixed_file_ ? 0 : opts_.fd;
    void* buf = reinterpret_cast<void*>(r->addr + r->done);
    const unsigned len = static_cast<unsigned>(r->length - r->done);
    const uint64_t off = r->offset + r->done;
    if (r->done == 0) r->buf_index = fixed_index(r->addr, r->length);
    if (r->buf_index >= 0) {
      if (r->write) {
        io_uring_prep_write_fixed(sqe, fd, buf, len, off, r->buf_index);
      } else {
        io_uring_prep_read_fixed(sqe, fd, buf, len, off, r->buf_index);
      }
    } else if (r->write) {
      io_uring_prep_write(sqe, fd, buf, len, off);
    } else {
      io_uring_prep_read(sqe, fd, buf, len, off);
    }
    if (fixed_file_) sqe->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data(sqe, r);
  }

  // Returns true when the request is finished (successfully or not).
  bool on_cqe(Request* r, int res) {
    if (res == -EAGAIN || res == -EINTR) return false;  // retry as is
    if (res < 0) {
      opts_.complete(r, -res, "");
      return true;
    }
    if (res == 0) {
      opts_.complete(r, r->write ? ENOSPC : EIO,
                     std::string("short ") + (r->write ? "write" : "read") + ": " +
                         std::to_string(r->done) + " of " + std::to_string(r->length) +
                         " bytes transferred (device ended)");
      return true;
    }
    r->done += static_cast<uint64_t>(res);
    if (r->done < r->length) return false;  // continue the remainder
    opts_.complete(r, 0, "");
    return true;
  }

  void loop() {
    arm_wake();
    std::deque<Request*> ready;  // requests to (re)submit, owned by this thread
    for (;;) {
      std::deque<std::function<void()>> controls;
      bool exit_now = false;
      {
        std::lock_guard<std::mutex> l(mu_);
        // Controls (buffer registration) run only with nothing in flight; hold back new I/O.
        if (!controls_.empty()) {
          if (inflight_ == 0 && ready.empty()) controls.swap(controls_);
        } else {
          while (!pending_.empty() && inflight_ + ready.size() < qd_) {
            ready.push_back(pending_.front());
            pending_.pop_front();
            --queued_;
          }
        }
        exit_now = stop_ && pending_.empty() && controls_.empty() && ready.empty() &&
                   inflight_ == 0 && controls.empty();
        if (exit_now) stopped_ = true;
      }
      for (auto& c : controls) c();
      if (exit_now) break;
      if (!controls.empty()) continue;
      while (!ready.empty()) {
        prep(ready.front());
        ready.pop_front();
        ++inflight_;
      }
      int rc = io_uring_submit_and_wait(&ring_, 1);
      if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
        fail_all(-rc);
        continue;
      }
      io_uring_cqe* cqe;
      unsigned head, seen = 0;
      io_uring_for_each_cqe(&ring_, head, cqe) {
        ++seen;
        if (cqe->user_data == kWakeTag) {
          uint64_t v;
          ssize_t n = read(efd_, &v, sizeof(v));
          (void)n;
          arm_wake();
          continue;
        }
        auto* r = static_cast<Request*>(io_uring_cqe_get_data(cqe));
        --inflight_;
        if (!on_cqe(r, cqe->res)) ready.push_front(r);
      }
      io_uring_cq_advance(&ring_, seen);
    }
  }

  // The ring itself failed (should not happen): complete everything queued with the error so no
  // caller waits forever.
  void fail_all(int err) {
    std::deque<Request*> drop;
    {
      std::lock_guard<std::mutex> l(mu_);
      drop.swap(pending_);
      queued_ = 0;
    }
    for (Request* r : drop) opts_.complete(r, err, "io_uring_submit failed");
  }

  BackendOptions opts_;
  unsigned qd_;
  io_uring ring_{};
  int efd_ = -1;
  bool sqpoll_ = false;
  bool fixed_file_ = false;
  std::vector<FixedBuf> fixed_;  // ring thread only (and under mu_ while publishing)
  mutable std::mutex mu_;
  std::mutex join_mu_;
  std::deque<Request*> pending_;
  std::deque<std::function<void()>> controls_;
  std::atomic<uint64_t> inflight_{0};
  std::atomic<uint64_t> queued_{0};
  bool stop_ = false;
  bool stopped_ = false;
  std::string note_;
  std::thread thread_;
};

}  // namespace

std::unique_ptr<Backend> make_uring_backend(const BackendOptions& opts) {
  return std::make_unique<UringBackend>(opts);
}

}  // namespace kvio
