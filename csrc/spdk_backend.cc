// SPDK backend (compiled only when CMake finds spdk_nvme + spdk_env_dpdk): user-space NVMe
// driver, controller attached by transport id (PCIe or NVMe-oF such as NVMe/TCP), one I/O qpair
// and one poller thread per device, host pools registered with spdk_mem_register.
//
// Not exercised by CI (SPDK is in no package registry); tests/kvio/test_spdk.py runs it when the
// module reports 'spdk' and KVPOOL_SPDK_TRID points at a reachable target.
#include <spdk/env.h>
#include <spdk/nvme.h>
#include <spdk/version.h>

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <thread>

#include "backend.h"
#include "common.h"

namespace kvio {
namespace {

// Process-wide SPDK state: the env is initialised once; memory registrations are refcounted
// because several devices may register the same host pools.
std::mutex g_spdk_mu;
bool g_env_ready = false;
std::map<uint64_t, std::pair<uint64_t, int>> g_registered;  // addr -> (length, refs)

void ensure_env(const std::string& device) {
  std::lock_guard<std::mutex> l(g_spdk_mu);
  if (g_env_ready) return;
  spdk_env_opts opts{};
#if SPDK_VERSION_MAJOR > 24 || (SPDK_VERSION_MAJOR == 24 && SPDK_VERSION_MINOR >= 9)
  opts.opts_size = sizeof(opts);
#endif
  spdk_env_opts_init(&opts);
  opts.name = "vllm_kvpool";
  // The poller threads are ordinary threads; the env only needs a core mask for DPDK's EAL.
  if (const char* mask = std::getenv("KVPOOL_SPDK_CORE_MASK")) opts.core_mask = mask;
  if (const char* mem = std::getenv("KVPOOL_SPDK_MEM_MB")) opts.mem_size = std::atoi(mem);
  const int rc = spdk_env_init(&opts);
  if (rc < 0) {
    throw Error(ErrorKind::Io, device, -1, -rc,
                "device '" + device + "': spdk_env_init failed: " + errno_text(-rc) +
                    " (huge pages configured? run SPDK's setup.sh)");
  }
  g_env_ready = true;
}

void mem_register(const Region& r) {
  std::lock_guard<std::mutex> l(g_spdk_mu);
  auto it = g_registered.find(r.addr);
  if (it != g_registered.end()) {
    ++it->second.second;
    return;
  }
  const int rc = spdk_mem_register(reinterpret_cast<void*>(r.addr), r.length);
  if (rc != 0) {
    throw Error(ErrorKind::Io, "spdk", -1, -rc,
                "spdk_mem_register of " + std::to_string(r.length) +
                    " bytes failed (regions must be 2 MiB aligned): " + errno_text(-rc));
  }
  g_registered[r.addr] = {r.length, 1};
}

void mem_unregister(const Region& r) {
  std::lock_guard<std::mutex> l(g_spdk_mu);
  auto it = g_registered.find(r.addr);
  if (it == g_registered.end()) return;
  if (--it->second.second == 0) {
    spdk_mem_unregister(reinterpret_cast<void*>(r.addr), it->second.first);
    g_registered.erase(it);
  }
}

struct AttachCtx {
  spdk_nvme_transport_id want{};
  spdk_nvme_ctrlr* ctrlr = nullptr;
};

bool on_probe(void* ctx, const spdk_nvme_transport_id* trid, spdk_nvme_ctrlr_opts*) {
  auto* c = static_cast<AttachCtx*>(ctx);
  // PCIe scans may report every controller on the bus: take only the requested one.
  return c->want.trtype != SPDK_NVME_TRANSPORT_PCIE ||
         spdk_nvme_transport_id_compare(&c->want, trid) == 0;
}

void on_attach(void* ctx, const spdk_nvme_transport_id*, spdk_nvme_ctrlr* ctrlr,
               const spdk_nvme_ctrlr_opts*) {
  auto* c = static_cast<AttachCtx*>(ctx);
  if (c->ctrlr == nullptr) {
    c->ctrlr = ctrlr;
  } else {
    spdk_nvme_detach(ctrlr);
  }
}

class SpdkBackend;
thread_local SpdkBackend* tl_self = nullptr;  // completions run on the poller thread

class SpdkBackend final : public Backend {
 public:
  SpdkBackend(const BackendOptions& o, const std::string& trid_text, SpdkGeometry* geo)
      : opts_(o), qd_(o.queue_depth ? o.queue_depth : 32) {
    ensure_env(o.device);
    // Optional " ns:N" selects the namespace (default: the first active one).
    std::string trid_str = trid_text;
    uint32_t nsid = 0;
    const auto pos = trid_str.find(" ns:");
    if (pos != std::string::npos) {
      nsid = static_cast<uint32_t>(std::strtoul(trid_str.c_str() + pos + 4, nullptr, 10));
      trid_str.erase(pos);
    }
    AttachCtx ctx;
    if (spdk_nvme_transport_id_parse(&ctx.want, trid_str.c_str()) != 0) {
      throw Error(ErrorKind::Value, o.device, -1, EINVAL,
                  "device '" + o.device + "': cannot parse SPDK transport id '" + trid_str + "'");
    }
    {
      std::lock_guard<std::mutex> l(g_spdk_mu);  // spdk_nvme_probe is not thread-safe
      if (spdk_nvme_probe(&ctx.want, &ctx, on_probe, on_attach, nullptr) != 0 || !ctx.ctrlr) {
        throw Error(ErrorKind::Io, o.device, -1, ENODEV,
                    "device '" + o.device + "': no NVMe controller attached for '" + trid_str +
                        "' (target reachable? already attached by this process?)");
      }
    }
    ctrlr_ = ctx.ctrlr;
    if (nsid == 0) nsid = spdk_nvme_ctrlr_get_first_active_ns(ctrlr_);
    ns_ = nsid ? spdk_nvme_ctrlr_get_ns(ctrlr_, nsid) : nullptr;
    if (!ns_ || !spdk_nvme_ns_is_active(ns_)) {
      spdk_nvme_detach(ctrlr_);
      throw Error(ErrorKind::Io, o.device, -1, ENODEV,
                  "device '" + o.device + "': namespace " + std::to_string(nsid) +
                      " is not active");
    }
    sector_ = spdk_nvme_ns_get_sector_size(ns_);
    geo->sector_size = sector_;
    geo->capacity = spdk_nvme_ns_get_size(ns_);
    qpair_ = spdk_nvme_ctrlr_alloc_io_qpair(ctrlr_, nullptr, 0);
    if (!qpair_) {
      spdk_nvme_detach(ctrlr_);
      throw Error(ErrorKind::Io, o.device, -1, ENOMEM,
                  "device '" + o.device + "': cannot allocate an NVMe I/O qpair");
    }
    thread_ = std::thread([this] { loop(); });
  }

  ~SpdkBackend() override {
    shutdown();
    for (const Region& r : regions_) mem_unregister(r);
    spdk_nvme_ctrlr_free_io_qpair(qpair_);
    spdk_nvme_detach(ctrlr_);
  }

  const char* name() const override { return "spdk"; }
  uint64_t inflight() const override { return inflight_.load() + queued_.load(); }

  void submit(const std::vector<Request*>& reqs) override {
    {
      std::lock_guard<std::mutex> l(mu_);
      for (Request* r : reqs) pending_.push_back(r);
      queued_ += reqs.size();
    }
    cv_.notify_one();
  }

  void register_regions(const std::vector<Region>& regions) override {
    auto task = std::make_shared<std::packaged_task<void()>>([this, regions] {
      for (const Region& r : regions_) mem_unregister(r);
      regions_.clear();
      for (const Region& r : regions) {
        mem_register(r);
        regions_.push_back(r);
      }
    });
    auto fut = task->get_future();
    {
      std::lock_guard<std::mutex> l(mu_);
      if (stopped_) return;
      controls_.push_back([task] { (*task)(); });
    }
    cv_.notify_one();
    fut.get();
  }

  void shutdown() override {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_one();
    std::lock_guard<std::mutex> j(join_mu_);
    if (thread_.joinable()) thread_.join();
  }

  static void on_io_done(void* arg, const spdk_nvme_cpl* cpl) {
    auto* r = static_cast<Request*>(arg);
    SpdkBackend* self = tl_self;
    --self->inflight_;
    if (spdk_nvme_cpl_is_error(cpl)) {
      self->opts_.complete(r, EIO,
                           "NVMe status sct=" + std::to_string(cpl->status.sct) +
                               " sc=" + std::to_string(cpl->status.sc));
    } else {
      self->opts_.complete(r, 0, "");
    }
  }

 private:
  int issue(Request* r) {
    void* buf = reinterpret_cast<void*>(r->addr);
    const uint64_t lba = r->offset / sector_;
    const auto count = static_cast<uint32_t>(r->length / sector_);
    return r->write ? spdk_nvme_ns_cmd_write(ns_, qpair_, buf, lba, count, on_io_done, r, 0)
                    : spdk_nvme_ns_cmd_read(ns_, qpair_, buf, lba, count, on_io_done, r, 0);
  }

  void loop() {
    tl_self = this;
    std::deque<Request*> ready;
    for (;;) {
      std::deque<std::function<void()>> controls;
      {
        std::unique_lock<std::mutex> l(mu_);
        if (inflight_ == 0 && ready.empty()) {
          // Idle: sleep until work arrives instead of spinning.
          cv_.wait(l, [&] { return stop_ || !pending_.empty() || !controls_.empty(); });
        }
        if (!controls_.empty() && inflight_ == 0 && ready.empty()) controls.swap(controls_);
        if (controls_.empty()) {
          while (!pending_.empty() && inflight_ + ready.size() < qd_) {
            ready.push_back(pending_.front());
            pending_.pop_front();
            --queued_;
          }
        }
        if (stop_ && pending_.empty() && controls_.empty() && controls.empty() &&
            ready.empty() && inflight_ == 0) {
          stopped_ = true;
          break;
        }
      }
      for (auto& c : controls) c();
      while (!ready.empty()) {
        Request* r = ready.front();
        if (failed_) {
          ready.pop_front();
          opts_.complete(r, ENXIO, "NVMe qpair failed (controller gone)");
          continue;
        }
        const int rc = issue(r);
        if (rc == -ENOMEM) break;  // qpair full: reap completions first
        ready.pop_front();
        if (rc != 0) {
          opts_.complete(r, -rc, rc == -EFAULT || rc == -EINVAL
                                     ? "SPDK rejected the buffer (not in a registered HostPool?)"
                                     : "");
          continue;
        }
        ++inflight_;
      }
      if (inflight_ > 0 && spdk_nvme_qpair_process_completions(qpair_, 0) < 0) {
        // The controller went away: SPDK aborts outstanding commands through their callbacks.
        failed_ = true;
      }
    }
  }

  BackendOptions opts_;
  unsigned qd_;
  spdk_nvme_ctrlr* ctrlr_ = nullptr;
  spdk_nvme_ns* ns_ = nullptr;
  spdk_nvme_qpair* qpair_ = nullptr;
  uint32_t sector_ = 512;
  std::vector<Region> regions_;  // poller thread only
  std::mutex mu_, join_mu_;
  std::condition_variable cv_;
  std::deque<Request*> pending_;
  std::deque<std::function<void()>> controls_;
  std::atomic<uint64_t> inflight_{0}, queued_{0};
  bool stop_ = false, stopped_ = false, failed_ = false;
  std::thread thread_;
};

}  // namespace

std::unique_ptr<Backend> make_spdk_backend(const BackendOptions& opts, const std::string& trid,
                                           SpdkGeometry* geometry) {
  return std::make_unique<SpdkBackend>(opts, trid, geometry);
}

}  // namespace kvio
