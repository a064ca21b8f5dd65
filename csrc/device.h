// A device (SSD, loop device, preallocated file, or SPDK namespace): its extent allocator,
// its backend, and the tickets of submitted batches.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "backend.h"
#include "extent_allocator.h"
#include "host_pool.h"

namespace kvio {

enum class Status { Ok, Corrupt, Error };

struct IoResult {
  uint32_t index = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  Status status = Status::Ok;
  uint64_t checksum = 0;
  int err = 0;
  std::string message;
};

// One chunk: the device range [offset, offset + length) and its host bytes, either one buffer
// (addr) or, when `segments` is non-empty, several buffers filled in order (scatter/gather:
// KV pages straight from/to a KV-cache tensor). The checksum covers the bytes in that order.
struct IoOp {
  uint64_t offset = 0;
  uint64_t addr = 0;
  uint64_t length = 0;
  std::optional<uint64_t> expected;  // reads only
  std::vector<Region> segments;
};

// Ops become one backend request per host buffer; an op's result is final when its last
// request completes (requests of op i are reqs[first_req[i] .. first_req[i + 1])).
struct Ticket {
  std::vector<Request> reqs;
  std::vector<IoResult> results;  // one per op
  std::vector<std::optional<uint64_t>> expected;
  std::vector<size_t> first_req;
  std::unique_ptr<std::atomic<uint32_t>[]> op_remaining;
  std::atomic<size_t> remaining{0};  // requests
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
};

struct DeviceOptions {
  std::string path;
  uint64_t capacity = 0;
  std::string backend = "uring";
  unsigned queue_depth = 32;
  bool sqpoll = false;
  bool create = true;
  std::string name;
  unsigned threads = 0;
  std::string spdk_core_mask;
};

struct DeviceStats {
  uint64_t bytes_read, bytes_written, reads, writes, errors, corrupt, inflight, reconnects;
};

class Device {
 public:
  explicit Device(const DeviceOptions& opts);
  ~Device();
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  const std::string& path() const { return opts_.path; }
  const std::string& name() const { return name_; }
  const std::string& backend_name() const { return opts_.backend; }
  const std::string& kind() const { return kind_; }
  uint64_t capacity() const { return capacity_; }
  uint64_t alignment() const { return align_; }
  uint64_t mem_alignment() const { return mem_align_; }
  unsigned queue_depth() const { return opts_.queue_depth; }
  // Largest transfer the backend issues as one command (ops are split to it); 0 = no limit.
  uint64_t max_transfer() const { return max_transfer_; }
  // "ok" | "reconnecting" | "failed" (SPDK controller lost) | "closed".
  std::string state() const;
  bool sqpoll() const;
  bool closed() const { return closed_.load(); }
  std::string note() const;
  ExtentAllocator& allocator() { return *alloc_; }

  void register_host_pools(const std::vector<std::shared_ptr<HostPool>>& pools);

  // Validates every op (alignment, range, open) before queueing anything; throws Error.
  uint64_t submit(bool write, const std::vector<IoOp>& ops);
  bool poll(uint64_t ticket);
  // Blocks until the ticket finishes (timeout_s < 0: forever); returns false on timeout.
  // On success moves the results out and forgets the ticket.
  bool wait(uint64_t ticket, double timeout_s, std::vector<IoResult>* out);
  DeviceStats stats() const;
  void close();

 private:
  void open_fd_device();
  void on_complete(Request* r, int err, const std::string& detail);
  void check_op(bool write, const IoOp& op) const;
  void finish_op(Ticket* t, uint32_t op);
  std::shared_ptr<Ticket> find(uint64_t ticket);

  DeviceOptions opts_;
  std::string name_;
  std::string kind_;
  std::string note_;
  int fd_ = -1;
  uint64_t capacity_ = 0;
  uint64_t align_ = 1;
  uint64_t mem_align_ = 1;
  uint64_t max_transfer_ = 0;
  std::unique_ptr<ExtentAllocator> alloc_;
  std::unique_ptr<Backend> backend_;
  std::vector<std::shared_ptr<HostPool>> pools_;  // keeps registered memory alive

  mutable std::mutex mu_;
  std::unordered_map<uint64_t, std::shared_ptr<Ticket>> tickets_;
  uint64_t next_ticket_ = 1;
  std::atomic<bool> closed_{false};
  std::mutex close_mu_;

  std::atomic<uint64_t> bytes_read_{0}, bytes_written_{0}, reads_{0}, writes_{0}, errors_{0},
      corrupt_{0};
};

}  // namespace kvio
