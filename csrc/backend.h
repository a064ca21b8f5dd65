// The one interface every I/O backend (uring, posix, spdk) implements.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace kvio {

struct Ticket;

// One chunk transfer between a device range and a host buffer.
struct Request {
  uint64_t offset = 0;  // device byte offset
  uint64_t addr = 0;    // host address
  uint64_t length = 0;
  bool write = false;
  uint64_t done = 0;    // bytes already transferred (short I/O is continued by the backend)
  int buf_index = -1;   // registered-buffer slot chosen by the backend, -1 = unregistered
  Ticket* ticket = nullptr;
  uint32_t index = 0;   // position in the ticket
};

// A host memory range to register with the backend (io_uring fixed buffers, spdk_mem_register).
struct Region {
  uint64_t addr;
  uint64_t length;
};

// Backends call this exactly once per request: err == 0 means all `length` bytes moved;
// otherwise err is an errno and `detail` may explain (e.g. "short read: 0 of 4096 bytes").
using CompletionFn = std::function<void(Request*, int err, const std::string& detail)>;

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  // Queues requests; never blocks on I/O. Thread-safe.
  virtual void submit(const std::vector<Request*>& reqs) = 0;
  // Replaces the registered memory regions; waits until no I/O is in flight. Thread-safe.
  virtual void register_regions(const std::vector<Region>& regions) = 0;
  // Finishes queued and in-flight requests, then stops the backend's threads.
  virtual void shutdown() = 0;
  // Fallbacks taken (e.g. "SQPOLL unavailable: ..."), "" when none.
  virtual std::string note() const { return ""; }
  virtual bool sqpoll() const { return false; }
  virtual uint64_t inflight() const = 0;
  // DMA by physical address (SPDK over PCIe): host pools must be hugetlb pages, which never move.
  virtual bool needs_hugetlb() const { return false; }
  // "ok", or for a backend that can lose its device (SPDK): "reconnecting" / "failed".
  virtual std::string state() const { return "ok"; }
  virtual uint64_t reconnects() const { return 0; }
};

struct BackendOptions {
  std::string device;     // name used in messages
  int fd = -1;            // uring / posix
  unsigned queue_depth = 32;
  bool sqpoll = false;
  unsigned threads = 0;   // posix workers, 0 = min(queue_depth, 8)
  std::string core_mask;  // spdk: CPUs of the controller's poller ("" = KVPOOL_SPDK_CORE_MASK)
  CompletionFn complete;
};

std::unique_ptr<Backend> make_uring_backend(const BackendOptions& opts);
std::unique_ptr<Backend> make_posix_backend(const BackendOptions& opts);

#ifdef KVPOOL_HAVE_SPDK
// SPDK needs no fd: it attaches the controller named by `trid` itself and reports the
// namespace geometry back.
struct SpdkGeometry {
  uint64_t capacity = 0;
  uint32_t sector_size = 0;
  uint32_t max_transfer = 0;  // bytes per NVMe command (ops are split to it)
};
std::unique_ptr<Backend> make_spdk_backend(const BackendOptions& opts, const std::string& trid,
                                           SpdkGeometry* geometry);
#endif

// Names of the backends compiled into this build, in preference order for the docs.
std::vector<std::string> compiled_backends();

}  // namespace kvio
