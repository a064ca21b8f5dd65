// SPDK backend (compiled only when CMake finds spdk_nvme + spdk_env_dpdk): user-space NVMe
// driver for a controller named by transport id (PCIe, or NVMe-oF such as NVMe/TCP).
//
// Threads: one poller per controller serves the I/O qpairs of every Device on it (one qpair per
// Device/namespace) and its admin queue (keep-alive, AER); one completion thread per Device runs
// the Device's completion callback (read checksums) off the poller. A lost connection fails the
// in-flight I/O (ECONNRESET), then the controller is reset with bounded quick retries; after them
// the device reports state "failed" and is retried every KVPOOL_SPDK_RETRY_INTERVAL_S until it
// comes back. SPDK's own log goes through the rate-limited engine log (log.h), never stderr.
//
// Not exercised by CI (SPDK is in no package registry); tests/kvio/test_kvio_spdk.py runs it when
// the module reports 'spdk' and KVPOOL_SPDK_TRID points at a reachable target.
#include <pthread.h>
#include <sched.h>
#include <spdk/env.h>
#include <spdk/log.h>
#include <spdk/nvme.h>
#include <spdk/version.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "backend.h"
#include "common.h"
#include "log.h"

namespace kvio {
namespace {

using Clock = std::chrono::steady_clock;

double env_double(const char* name, double def) {
  const char* v = std::getenv(name);
  return v && *v ? std::atof(v) : def;
}

// ---- SPDK log -> engine log (rate-limited per source line) ----
void on_spdk_log(int level, const char* file, const int line, const char* func, const char* fmt,
                 va_list args) {
  if (level > SPDK_LOG_NOTICE) return;  // INFO/DEBUG: SPDK's own debug output
  char buf[512];
  std::vsnprintf(buf, sizeof(buf), fmt, args);
  std::string msg(buf);
  while (!msg.empty() && (msg.back() == '\n' || msg.back() == ' ')) msg.pop_back();
  const char* base = std::strrchr(file ? file : "", '/');
  const std::string where = std::string(base ? base + 1 : (file ? file : "?")) + ":" +
                            std::to_string(line);
  const int py = level <= SPDK_LOG_ERROR ? kLogError
                 : level == SPDK_LOG_WARN ? kLogWarning
                                          : kLogInfo;
  engine_log(py, "spdk " + where, "spdk: " + msg + " (" + where + " " + (func ? func : "") + ")");
}

// ---- CPU sets: "0x3", "3", "[0-1]", "0,2-3" ----
bool parse_cpus(const std::string& text, cpu_set_t* set) {
  CPU_ZERO(set);
  std::string s;
  for (char c : text) {
    if (c != '[' && c != ']' && c != ' ') s += c;
  }
  if (s.empty()) return false;
  if (s.rfind("0x", 0) == 0 || s.rfind("0X", 0) == 0) {
    const std::string hex = s.substr(2);
    if (hex.empty()) return false;
    int bit = 0;
    for (auto it = hex.rbegin(); it != hex.rend(); ++it) {
      const char c = static_cast<char>(std::tolower(*it));
      int v;
      if (c >= '0' && c <= '9') v = c - '0';
      else if (c >= 'a' && c <= 'f') v = c - 'a' + 10;
      else return false;
      for (int b = 0; b < 4; ++b, ++bit) {
        if ((v >> b) & 1) {
          if (bit >= CPU_SETSIZE) return false;
          CPU_SET(bit, set);
        }
      }
    }
    return CPU_COUNT(set) > 0;
  }
  size_t pos = 0;
  while (pos < s.size()) {
    const size_t end = std::min(s.find(',', pos), s.size());
    const std::string item = s.substr(pos, end - pos);
    const size_t dash = item.find('-');
    char* e1 = nullptr;
    char* e2 = nullptr;
    const long lo = std::strtol(item.c_str(), &e1, 10);
    long hi = lo;
    if (dash != std::string::npos) hi = std::strtol(item.c_str() + dash + 1, &e2, 10);
    if (item.empty() || lo < 0 || hi < lo || hi >= CPU_SETSIZE) return false;
    if (dash == std::string::npos ? *e1 != '\0' : (e1 != item.c_str() + dash || *e2 != '\0')) {
      return false;
    }
    for (long c = lo; c <= hi; ++c) CPU_SET(static_cast<int>(c), set);
    pos = end + 1;
  }
  return CPU_COUNT(set) > 0;
}

std::string first_cpu_mask(const cpu_set_t& set) {
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) {
      std::string mask = "0x1";
      mask.append(static_cast<size_t>(c / 4), '0');
      mask[2] = "1248"[c % 4];
      return mask;
    }
  }
  return "0x1";
}

// ---- process-wide SPDK state ----
std::mutex g_spdk_mu;  // env init, spdk_nvme_connect/detach, controller registry
bool g_env_ready = false;
std::mutex g_mem_mu;
std::map<uint64_t, std::pair<uint64_t, int>> g_registered;  // addr -> (length, refs)

// DPDK's EAL pins the thread that initialises it to its main lcore; the caller's affinity is
// saved and restored so neither it nor threads it starts later are moved.
// Without a PCIe controller to drive, the PCI bus is not scanned (DPDK would otherwise probe every
// device it has a driver for, e.g. the VM's virtio NIC); KVPOOL_SPDK_PCI=1 scans it anyway.
bool g_pci_scanned = false;

void ensure_env(const std::string& device, const std::string& core_mask, bool pcie) {
  if (g_env_ready) return;
  cpu_set_t caller;
  CPU_ZERO(&caller);
  pthread_getaffinity_np(pthread_self(), sizeof(caller), &caller);
  spdk_log_open(on_spdk_log);
  spdk_env_opts opts{};
  opts.opts_size = sizeof(opts);
  spdk_env_opts_init(&opts);
  opts.name = "vllm_kvpool";
  // The EAL needs one core; with no mask given, the first core the caller may run on.
  const std::string mask = core_mask.empty() ? first_cpu_mask(caller) : core_mask;
  opts.core_mask = mask.c_str();
  static char eal_args[] = "--log-level=lib.eal:4";  // EAL errors only; the rest is noise here
  opts.env_context = eal_args;
  if (const char* mem = std::getenv("KVPOOL_SPDK_MEM_MB")) opts.mem_size = std::atoi(mem);
  const char* pci = std::getenv("KVPOOL_SPDK_PCI");
  opts.no_pci = !pcie && !(pci && std::string(pci) == "1");
  g_pci_scanned = !opts.no_pci;
  const int rc = spdk_env_init(&opts);
  pthread_setaffinity_np(pthread_self(), sizeof(caller), &caller);
  if (rc < 0) {
    throw Error(ErrorKind::Io, device, -1, -rc,
                "device '" + device + "': spdk_env_init (core mask " + mask + ") failed: " +
                    errno_text(-rc) + " (huge pages reserved? echo N > /proc/sys/vm/nr_hugepages)");
  }
  g_env_ready = true;
}

void mem_register(const std::string& device, const Region& r) {
  std::lock_guard<std::mutex> l(g_mem_mu);
  auto it = g_registered.find(r.addr);
  if (it != g_registered.end()) {
    ++it->second.second;
    return;
  }
  const int rc = spdk_mem_register(reinterpret_cast<void*>(r.addr), r.length);
  if (rc != 0) {
    throw Error(ErrorKind::Io, device, -1, -rc,
                "device '" + device + "': spdk_mem_register of " + std::to_string(r.length) +
                    " bytes failed (regions must be 2 MiB aligned): " + errno_text(-rc));
  }
  g_registered[r.addr] = {r.length, 1};
}

void mem_unregister(const Region& r) {
  std::lock_guard<std::mutex> l(g_mem_mu);
  auto it = g_registered.find(r.addr);
  if (it == g_registered.end()) return;
  if (--it->second.second == 0) {
    spdk_mem_unregister(reinterpret_cast<void*>(r.addr), it->second.first);
    g_registered.erase(it);
  }
}

std::string failure_reason(spdk_nvme_qpair* q) {
  switch (q ? spdk_nvme_qpair_get_failure_reason(q) : SPDK_NVME_QPAIR_FAILURE_UNKNOWN) {
    case SPDK_NVME_QPAIR_FAILURE_NONE: return "no transport failure";
    case SPDK_NVME_QPAIR_FAILURE_LOCAL: return "local transport failure";
    case SPDK_NVME_QPAIR_FAILURE_REMOTE: return "remote end closed the connection";
    case SPDK_NVME_QPAIR_FAILURE_RESET: return "controller reset";
    default: return "unknown transport failure";
  }
}

// Runs a Device's completion callback on its own thread (read checksums stay off the poller).
class Completer {
 public:
  struct Done {
    Request* req;
    int err;
    std::string detail;
  };
  explicit Completer(CompletionFn fn) : fn_(std::move(fn)), thread_([this] { run(); }) {}
  ~Completer() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }
  void push(Done d) {
    {
      std::lock_guard<std::mutex> l(mu_);
      q_.push_back(std::move(d));
    }
    cv_.notify_one();
  }

 private:
  void run() {
    pthread_setname_np(pthread_self(), "kvio-spdk-done");
    std::deque<Done> batch;
    for (;;) {
      {
        std::unique_lock<std::mutex> l(mu_);
        cv_.wait(l, [&] { return stop_ || !q_.empty(); });
        if (q_.empty()) return;  // stop_ and drained
        batch.swap(q_);
      }
      for (Done& d : batch) fn_(d.req, d.err, d.detail);
      batch.clear();
    }
  }
  CompletionFn fn_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Done> q_;
  bool stop_ = false;
  std::thread thread_;
};

enum class State { Ok, Reconnecting, Failed, Removed };

const char* state_name(State s) {
  switch (s) {
    case State::Ok: return "ok";
    case State::Reconnecting: return "reconnecting";
    default: return "failed";
  }
}

class Controller;

// One Device: a namespace and its I/O qpair on a shared controller.
struct Queue {
  BackendOptions opts;
  uint32_t nsid = 0;
  spdk_nvme_ns* ns = nullptr;         // poller thread (re-fetched after a reset)
  spdk_nvme_qpair* qpair = nullptr;   // poller thread
  uint32_t sector = 512;
  uint64_t ns_size = 0;
  uint32_t max_xfer = 0;              // bytes per NVMe command
  unsigned qd = 32;                   // NVMe commands in flight
  unsigned cmds = 0;                  // poller thread
  std::deque<struct Tracker*> ready;  // poller thread: requests with commands left to issue
  std::deque<Request*> pending;       // guarded by Controller::mu_
  bool paused = false;                // guarded by Controller::mu_ (re-registering memory)
  std::atomic<uint64_t> outstanding{0};  // submitted, completion callback not yet run
  std::atomic<uint64_t> unfinished{0};   // submitted, not yet completed (what stats() reports)
  std::atomic<uint64_t> active{0};       // taken by the poller, not yet finished
  std::unique_ptr<Completer> completer;
  std::vector<Region> regions;
  Controller* ctrl = nullptr;
};

// One request split into NVMe commands of at most max_xfer bytes.
struct Tracker {
  Tracker(Request* r, Queue* queue) : req(r), q(queue) {}
  Request* req;
  Queue* q;
  uint64_t issued = 0;
  unsigned outstanding = 0;
  bool in_ready = true;
  int err = 0;
  std::string detail;
};

class Controller {
 public:
  Controller(const spdk_nvme_transport_id& trid, const std::string& trid_text,
             spdk_nvme_ctrlr* ctrlr, const std::string& core_mask)
      : trid_(trid), trid_text_(trid_text), ctrlr_(ctrlr), core_mask_(core_mask),
        max_quick_retries_(static_cast<unsigned>(env_double("KVPOOL_SPDK_RECONNECT_RETRIES", 8))),
        retry_interval_(env_double("KVPOOL_SPDK_RETRY_INTERVAL_S", 5.0)) {
    spdk_nvme_ctrlr_register_aer_callback(ctrlr_, &Controller::on_aer, this);
    thread_ = std::thread([this] { loop(); });
  }

  ~Controller() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
      flag_ = true;
    }
    cv_.notify_one();
    thread_.join();
    std::lock_guard<std::mutex> l(g_spdk_mu);
    spdk_nvme_detach(ctrlr_);
  }

  const std::string& trid_text() const { return trid_text_; }
  const std::string& core_mask() const { return core_mask_; }
  bool is_pcie() const { return trid_.trtype == SPDK_NVME_TRANSPORT_PCIE; }
  State state() const { return state_.load(); }
  uint64_t reconnects() const { return reconnects_.load(); }
  bool same(const spdk_nvme_transport_id& t) const {
    return spdk_nvme_transport_id_compare(&trid_, &t) == 0;
  }

  // Runs `fn` on the poller thread and waits for it.
  void run_on_poller(std::function<void()> fn) {
    auto task = std::make_shared<std::packaged_task<void()>>(std::move(fn));
    auto fut = task->get_future();
    {
      std::lock_guard<std::mutex> l(mu_);
      controls_.push_back([task] { (*task)(); });
      flag_ = true;
    }
    cv_.notify_one();
    fut.get();
  }

  uint32_t first_active_ns() {
    uint32_t nsid = 0;
    run_on_poller([&] { nsid = spdk_nvme_ctrlr_get_first_active_ns(ctrlr_); });
    return nsid ? nsid : 1;
  }

  void add_queue(Queue* q) {
    run_on_poller([&] {
      if (state_ != State::Ok) {
        throw Error(ErrorKind::Io, q->opts.device, -1, ENOTCONN,
                    "device '" + q->opts.device + "': controller '" + trid_text_ + "' is " +
                        state_name(state_) + "; cannot open a queue on it now");
      }
      attach_ns(q);
      spdk_nvme_io_qpair_opts qo{};
      spdk_nvme_ctrlr_get_default_io_qpair_opts(ctrlr_, &qo, sizeof(qo));
      // SPDK request objects: our commands plus the children it may split one into (stripes).
      qo.io_queue_requests = std::max<uint32_t>(qo.io_queue_requests, 4 * q->qd + 16);
      q->qpair = spdk_nvme_ctrlr_alloc_io_qpair(ctrlr_, &qo, sizeof(qo));
      if (!q->qpair) {
        throw Error(ErrorKind::Io, q->opts.device, -1, ENOMEM,
                    "device '" + q->opts.device + "': cannot allocate an NVMe I/O qpair on '" +
                        trid_text_ + "'");
      }
      queues_.push_back(q);
    });
  }

  void remove_queue(Queue* q) {
    run_on_poller([&] {
      queues_.erase(std::remove(queues_.begin(), queues_.end(), q), queues_.end());
      if (q->qpair) spdk_nvme_ctrlr_free_io_qpair(q->qpair);
      q->qpair = nullptr;
    });
  }

  void submit(Queue* q, const std::vector<Request*>& reqs) {
    {
      std::lock_guard<std::mutex> l(mu_);
      for (Request* r : reqs) q->pending.push_back(r);
      flag_ = true;
    }
    cv_.notify_one();
  }

  void set_paused(Queue* q, bool paused) {
    {
      std::lock_guard<std::mutex> l(mu_);
      q->paused = paused;
      flag_ = true;
    }
    cv_.notify_one();
  }

 private:
  static void on_aer(void* arg, const spdk_nvme_cpl* cpl) {
    auto* self = static_cast<Controller*>(arg);
    engine_log(kLogInfo, "aer " + self->trid_text_,
               "spdk: asynchronous event from '" + self->trid_text_ + "' (cdw0=" +
                   std::to_string(cpl->cdw0) + ")");
  }

  static void on_cmd_done(void* arg, const spdk_nvme_cpl* cpl) {
    auto* t = static_cast<Tracker*>(arg);
    Queue* q = t->q;
    --q->cmds;
    --t->outstanding;
    if (spdk_nvme_cpl_is_error(cpl) && !t->err) {
      Controller* c = q->ctrl;
      const bool aborted = cpl->status.sct == SPDK_NVME_SCT_GENERIC &&
                           cpl->status.sc == SPDK_NVME_SC_ABORTED_SQ_DELETION;
      if (aborted && (c->state_ != State::Ok ||
                      spdk_nvme_qpair_get_failure_reason(q->qpair) != SPDK_NVME_QPAIR_FAILURE_NONE)) {
        t->err = ECONNRESET;
        t->detail = "connection to the NVMe controller '" + c->trid_text_ + "' lost (" +
                    c->lost_reason_ + "); the device is reconnecting";
      } else {
        t->err = EIO;
        t->detail = std::string("NVMe status ") + spdk_nvme_cpl_get_status_string(&cpl->status) +
                    " (sct=" + std::to_string(cpl->status.sct) +
                    " sc=" + std::to_string(cpl->status.sc) + ")";
      }
    }
    if (t->outstanding == 0 && !t->in_ready) finish(t);
  }

  static void finish(Tracker* t) {
    Queue* q = t->q;
    q->completer->push({t->req, t->err, std::move(t->detail)});
    --q->active;
    delete t;
  }

  void attach_ns(Queue* q) {
    q->ns = spdk_nvme_ctrlr_get_ns(ctrlr_, q->nsid);
    if (!q->ns || !spdk_nvme_ns_is_active(q->ns)) {
      throw Error(ErrorKind::Io, q->opts.device, -1, ENODEV,
                  "device '" + q->opts.device + "': namespace " + std::to_string(q->nsid) +
                      " of '" + trid_text_ + "' is not active");
    }
    q->sector = spdk_nvme_ns_get_sector_size(q->ns);
    q->ns_size = spdk_nvme_ns_get_size(q->ns);
    const uint32_t mx = spdk_nvme_ns_get_max_io_xfer_size(q->ns);
    q->max_xfer = std::max<uint32_t>(mx / q->sector * q->sector, q->sector);
  }

  // Moves submitted requests to the poller (or fails them while the controller is down).
  void take_incoming() {
    std::vector<std::function<void()>> controls;
    {
      std::lock_guard<std::mutex> l(mu_);
      flag_ = false;
      controls.swap(controls_);
      if (stop_) stop_seen_ = true;
      for (Queue* q : queues_) {
        if (q->paused) continue;
        while (!q->pending.empty()) {
          Request* r = q->pending.front();
          q->pending.pop_front();
          ++q->active;
          auto* t = new Tracker(r, q);
          q->ready.push_back(t);
        }
      }
    }
    for (auto& c : controls) c();
    if (state_ != State::Ok) {
      for (Queue* q : queues_) fail_ready(q, down_errno(), down_detail());
    }
  }

  int down_errno() const { return state_ == State::Reconnecting ? ENOTCONN : ENODEV; }
  std::string down_detail() const {
    if (state_ == State::Reconnecting) {
      return "device is reconnecting to the NVMe controller '" + trid_text_ + "' (" +
             lost_reason_ + ")";
    }
    if (state_ == State::Removed) return "NVMe controller '" + trid_text_ + "' was removed";
    return "device marked failed: " + std::to_string(attempts_) + " reconnect attempts to '" +
           trid_text_ + "' failed (" + lost_reason_ + "); retrying every " +
           std::to_string(static_cast<int>(retry_interval_)) + " s";
  }

  void fail_ready(Queue* q, int err, const std::string& detail) {
    while (!q->ready.empty()) {
      Tracker* t = q->ready.front();
      q->ready.pop_front();
      t->in_ready = false;
      if (!t->err) {
        t->err = err;
        t->detail = detail;
      }
      if (t->outstanding == 0) finish(t);
    }
  }

  void issue(Queue* q) {
    while (!q->ready.empty() && q->cmds < q->qd && state_ == State::Ok) {
      Tracker* t = q->ready.front();
      Request* r = t->req;
      if (t->err) {  // a command of it failed: issue no more
        q->ready.pop_front();
        t->in_ready = false;
        if (t->outstanding == 0) finish(t);
        continue;
      }
      const uint64_t len = std::min<uint64_t>(q->max_xfer, r->length - t->issued);
      void* buf = reinterpret_cast<void*>(r->addr + t->issued);
      const uint64_t lba = (r->offset + t->issued) / q->sector;
      const auto count = static_cast<uint32_t>(len / q->sector);
      const int rc = r->write ? spdk_nvme_ns_cmd_write(q->ns, q->qpair, buf, lba, count,
                                                       &Controller::on_cmd_done, t, 0)
                              : spdk_nvme_ns_cmd_read(q->ns, q->qpair, buf, lba, count,
                                                      &Controller::on_cmd_done, t, 0);
      if (rc == -ENOMEM) return;  // SPDK request objects exhausted: reap completions first
      if (rc == -ENXIO) {
        lost(failure_reason(q->qpair));
        return;
      }
      if (rc != 0) {
        t->err = -rc;
        t->detail = rc == -EFAULT || rc == -EINVAL
                        ? "SPDK cannot map the host buffer for DMA (not in a registered HostPool?)"
                        : "SPDK refused the command";
        continue;  // popped on the next pass
      }
      ++q->cmds;
      ++t->outstanding;
      t->issued += len;
      if (t->issued == r->length) {
        q->ready.pop_front();
        t->in_ready = false;
      }
    }
  }

  // The connection (or the controller) is gone: fail what is in flight, start reconnecting.
  void lost(const std::string& reason) {
    if (state_ != State::Ok) return;
    lost_reason_ = reason;
    state_ = State::Reconnecting;
    attempts_ = 0;
    next_retry_ = Clock::now();
    engine_log(kLogWarning, "lost " + trid_text_,
               "spdk: connection to NVMe controller '" + trid_text_ + "' lost (" + reason +
                   "); failing in-flight I/O and reconnecting");
    for (Queue* q : queues_) {
      fail_ready(q, ECONNRESET,
                 "connection to the NVMe controller '" + trid_text_ + "' lost (" + reason + ")");
      if (q->qpair) spdk_nvme_ctrlr_disconnect_io_qpair(q->qpair);  // aborts its commands
      if (q->cmds) spdk_nvme_qpair_process_completions(q->qpair, 0);
    }
  }

  bool reconnect_once() {
    const int rc = spdk_nvme_ctrlr_disconnect(ctrlr_);
    if (rc == -ENXIO) {
      state_ = State::Removed;
      return false;
    }
    if (rc == 0) {  // wait for the admin queue to finish disconnecting
      const auto until = Clock::now() + std::chrono::seconds(1);
      while (spdk_nvme_ctrlr_process_admin_completions(ctrlr_) != -ENXIO && Clock::now() < until) {
      }
    }
    spdk_nvme_ctrlr_reconnect_async(ctrlr_);
    int prc;
    while ((prc = spdk_nvme_ctrlr_reconnect_poll_async(ctrlr_)) == -EAGAIN) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    if (prc != 0) return false;
    for (Queue* q : queues_) {
      try {
        attach_ns(q);  // namespace handles may be invalidated by a reset
      } catch (const Error& e) {
        engine_log(kLogError, "ns " + trid_text_, std::string("spdk: ") + e.what());
        return false;
      }
      const auto until = Clock::now() + std::chrono::seconds(10);
      int qrc;
      while ((qrc = spdk_nvme_ctrlr_reconnect_io_qpair(q->qpair)) == -EAGAIN &&
             Clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      if (qrc != 0) return false;
    }
    return true;
  }

  void try_reconnect(Clock::time_point now) {
    for (Queue* q : queues_) {  // commands aborted by the disconnect complete here
      if (q->cmds && q->qpair) spdk_nvme_qpair_process_completions(q->qpair, 0);
    }
    ++attempts_;
    if (reconnect_once()) {
      state_ = State::Ok;
      ++reconnects_;
      engine_log(kLogWarning, "recovered " + trid_text_,
                 "spdk: reconnected to NVMe controller '" + trid_text_ + "' after " +
                     std::to_string(attempts_) + " attempt(s); device is ok again");
      return;
    }
    if (state_ == State::Removed) {
      engine_log(kLogError, "removed " + trid_text_,
                 "spdk: NVMe controller '" + trid_text_ + "' was removed; device marked failed");
      return;
    }
    if (state_ == State::Reconnecting && attempts_ >= max_quick_retries_) {
      state_ = State::Failed;
      engine_log(kLogError, "failed " + trid_text_,
                 "spdk: " + std::to_string(attempts_) + " reconnect attempts to '" + trid_text_ +
                     "' failed; device marked failed, retrying every " +
                     std::to_string(retry_interval_) + " s");
    }
    const double backoff = state_ == State::Failed
                               ? retry_interval_
                               : std::min(2.0, 0.1 * static_cast<double>(1u << std::min(attempts_, 5u)));
    next_retry_ = now + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(backoff));
  }

  void pin_thread() {
    if (core_mask_.empty()) return;  // the process's own affinity
    cpu_set_t set;
    if (parse_cpus(core_mask_, &set)) pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
  }

  void loop() {
    pthread_setname_np(pthread_self(), "kvio-spdk-poll");
    pin_thread();
    auto next_admin = Clock::now();
    unsigned empty_polls = 0;
    for (;;) {
      if (flag_.load(std::memory_order_acquire)) take_incoming();
      if (stop_seen_ && queues_.empty()) return;
      bool busy = false, progress = false;
      for (Queue* q : queues_) issue(q);
      for (Queue* q : queues_) {
        if (!q->cmds || !q->qpair) continue;
        busy = true;
        const int rc = spdk_nvme_qpair_process_completions(q->qpair, 0);
        if (rc > 0) progress = true;
        if (rc < 0 && state_ == State::Ok) lost(failure_reason(q->qpair));
      }
      const auto now = Clock::now();
      if (state_ == State::Ok && now >= next_admin) {
        // Keep-alive and AERs: SPDK sends Keep Alive from here, so poll it even when idle.
        if (spdk_nvme_ctrlr_process_admin_completions(ctrlr_) < 0) {
          lost("admin queue failed (" + failure_reason(nullptr) + ")");
        }
        next_admin = now + (busy ? std::chrono::milliseconds(10) : std::chrono::milliseconds(100));
      }
      if (state_ != State::Ok && state_ != State::Removed && now >= next_retry_) {
        try_reconnect(now);
      }
      bool ready = false;
      for (Queue* q : queues_) ready |= !q->ready.empty();
      if (!busy && !ready) {
        std::unique_lock<std::mutex> l(mu_);
        auto until = next_admin;
        if (state_ == State::Reconnecting || state_ == State::Failed) until = next_retry_;
        if (state_ == State::Removed) until = Clock::now() + std::chrono::seconds(1);
        cv_.wait_until(l, until, [&] { return flag_.load(); });
      } else if (!progress && ++empty_polls >= 64) {
        empty_polls = 0;
        sched_yield();  // let the completion thread (checksums) run when sharing a core
      }
    }
  }

  const spdk_nvme_transport_id trid_;
  const std::string trid_text_;
  spdk_nvme_ctrlr* const ctrlr_;
  const std::string core_mask_;
  const unsigned max_quick_retries_;
  const double retry_interval_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> flag_{false};  // set under mu_: pending work or controls
  std::vector<std::function<void()>> controls_;
  bool stop_ = false;

  // poller thread
  std::vector<Queue*> queues_;
  bool stop_seen_ = false;
  std::string lost_reason_;
  unsigned attempts_ = 0;
  Clock::time_point next_retry_{};
  std::atomic<State> state_{State::Ok};
  std::atomic<uint64_t> reconnects_{0};
  std::thread thread_;
};

// Controllers by transport id: Devices on namespaces of one controller (or several Devices on
// one namespace) share it and its poller.
std::vector<std::weak_ptr<Controller>> g_controllers;  // guarded by g_spdk_mu

std::shared_ptr<Controller> attach_controller(const std::string& device,
                                              const spdk_nvme_transport_id& trid,
                                              const std::string& trid_text,
                                              const std::string& core_mask) {
  std::lock_guard<std::mutex> l(g_spdk_mu);
  const bool pcie = trid.trtype == SPDK_NVME_TRANSPORT_PCIE;
  ensure_env(device, core_mask, pcie);
  std::shared_ptr<Controller> found;
  auto& v = g_controllers;
  v.erase(std::remove_if(v.begin(), v.end(), [](const auto& w) { return w.expired(); }), v.end());
  for (const auto& w : v) {
    auto c = w.lock();
    if (c && c->same(trid)) found = c;
  }
  if (found) {
    if (!core_mask.empty() && core_mask != found->core_mask()) {
      engine_log(kLogWarning, "mask " + trid_text,
                 "spdk: device '" + device + "' asks for poller core mask " + core_mask +
                     " but controller '" + trid_text + "' is already polled with mask '" +
                     found->core_mask() + "' (one poller per controller)");
    }
    return found;
  }
  spdk_nvme_ctrlr_opts copts{};
  spdk_nvme_ctrlr_get_default_ctrlr_opts(&copts, sizeof(copts));
  spdk_nvme_ctrlr* ctrlr = spdk_nvme_connect(&trid, &copts, sizeof(copts));
  if (!ctrlr) {
    const std::string hint =
        pcie && !g_pci_scanned
            ? "the first SPDK device of this process was NVMe-oF, so the PCI bus was not "
              "scanned: set KVPOOL_SPDK_PCI=1"
            : "target reachable? PCIe device bound to vfio-pci/uio by SPDK's setup.sh?";
    throw Error(ErrorKind::Io, device, -1, ENODEV,
                "device '" + device + "': cannot attach the NVMe controller '" + trid_text +
                    "' (" + hint + ")");
  }
  auto c = std::make_shared<Controller>(trid, trid_text, ctrlr, core_mask);
  v.push_back(c);
  return c;
}

class SpdkBackend final : public Backend {
 public:
  SpdkBackend(const BackendOptions& o, const std::string& trid_text, SpdkGeometry* geo) {
    q_.opts = o;
    q_.qd = o.queue_depth ? o.queue_depth : 32;
    // Optional " ns:N" selects the namespace (default: the first active one).
    std::string trid_str = trid_text;
    const auto pos = trid_str.find(" ns:");
    if (pos != std::string::npos) {
      char* end = nullptr;
      const unsigned long n = std::strtoul(trid_str.c_str() + pos + 4, &end, 10);
      if (end == trid_str.c_str() + pos + 4 || n == 0 || n > UINT32_MAX) {
        throw Error(ErrorKind::Value, o.device, -1, EINVAL,
                    "device '" + o.device + "': bad namespace id in '" + trid_text + "'");
      }
      q_.nsid = static_cast<uint32_t>(n);
      trid_str.erase(pos);
    }
    spdk_nvme_transport_id trid{};
    if (spdk_nvme_transport_id_parse(&trid, trid_str.c_str()) != 0) {
      throw Error(ErrorKind::Value, o.device, -1, EINVAL,
                  "device '" + o.device + "': cannot parse SPDK transport id '" + trid_str + "'");
    }
    std::string mask = o.core_mask;
    if (mask.empty()) {
      const char* env = std::getenv("KVPOOL_SPDK_CORE_MASK");
      mask = env ? env : "";
    }
    cpu_set_t probe_set;
    if (!mask.empty() && !parse_cpus(mask, &probe_set)) {
      throw Error(ErrorKind::Value, o.device, -1, EINVAL,
                  "device '" + o.device + "': SPDK core mask '" + mask +
                      "' is neither a hex mask (0x3) nor a CPU list (0,2-3)");
    }
    ctrl_ = attach_controller(o.device, trid, trid_str, mask);
    q_.ctrl = ctrl_.get();
    if (q_.nsid == 0) q_.nsid = ctrl_->first_active_ns();
    q_.completer = std::make_unique<Completer>(
        [this](Request* r, int err, const std::string& detail) {
          // Not in flight any more before the waiter wakes: stats() right after wait() reads 0.
          --q_.unfinished;
          q_.opts.complete(r, err, detail);
          --q_.outstanding;  // after the callback: close() waits for this
        });
    ctrl_->add_queue(&q_);
    geo->sector_size = q_.sector;
    geo->capacity = q_.ns_size;
    geo->max_transfer = q_.max_xfer;
  }

  ~SpdkBackend() override {
    shutdown();
    for (const Region& r : q_.regions) mem_unregister(r);
  }

  const char* name() const override { return "spdk"; }
  uint64_t inflight() const override { return q_.unfinished.load(); }
  bool needs_hugetlb() const override { return ctrl_ && ctrl_->is_pcie(); }
  std::string state() const override {
    return ctrl_ ? state_name(ctrl_->state()) : "closed";
  }
  uint64_t reconnects() const override { return ctrl_ ? ctrl_->reconnects() : 0; }

  void submit(const std::vector<Request*>& reqs) override {
    q_.outstanding += reqs.size();
    q_.unfinished += reqs.size();
    ctrl_->submit(&q_, reqs);
  }

  void register_regions(const std::vector<Region>& regions) override {
    // Wait until nothing of this device is in flight, then swap the registrations.
    ctrl_->set_paused(&q_, true);
    while (q_.active.load() != 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
    try {
      for (const Region& r : q_.regions) mem_unregister(r);
      q_.regions.clear();
      for (const Region& r : regions) {
        mem_register(q_.opts.device, r);
        q_.regions.push_back(r);
      }
    } catch (...) {
      ctrl_->set_paused(&q_, false);
      throw;
    }
    ctrl_->set_paused(&q_, false);
  }

  void shutdown() override {
    std::lock_guard<std::mutex> j(shutdown_mu_);
    if (!ctrl_) return;
    while (q_.outstanding.load() != 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
    ctrl_->remove_queue(&q_);
    q_.completer.reset();
    q_.ctrl = nullptr;
    ctrl_.reset();  // the last Device on a controller stops its poller and detaches it
  }

 private:
  Queue q_;
  std::shared_ptr<Controller> ctrl_;
  std::mutex shutdown_mu_;
};

}  // namespace

std::unique_ptr<Backend> make_spdk_backend(const BackendOptions& opts, const std::string& trid,
                                           SpdkGeometry* geometry) {
  return std::make_unique<SpdkBackend>(opts, trid, geometry);
}

}  // namespace kvio
