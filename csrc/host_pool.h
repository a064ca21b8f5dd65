// A host memory pool: one 2 MiB-aligned region (per NUMA node), huge pages when possible,
// optionally mlocked, carved into extents for staging KV chunks. A shared pool lives in a memfd
// (hugetlbfs-backed when huge pages are free) that another process maps with `attach`: the
// per-node pool service creates it and passes the fd to engines over a Unix socket.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "extent_allocator.h"

namespace kvio {

class HostPool {
 public:
  // numa_node < 0: no binding. Throws Error on failure (nothing leaks).
  HostPool(uint64_t capacity, int numa_node, bool hugepages, bool mlock, std::string name,
           bool shared = false);
  // Maps `capacity` bytes of a shared pool's memfd created by another process (the fd is
  // duplicated, the caller keeps its own). Its bytes are left as they are (no pre-fault write).
  static std::shared_ptr<HostPool> attach(int fd, uint64_t capacity, bool mlock, std::string name);
  ~HostPool();
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  uint8_t* data() const { return base_; }
  uint64_t address() const { return reinterpret_cast<uint64_t>(base_); }
  uint64_t capacity() const { return capacity_; }
  int numa_node() const { return numa_node_; }
  bool hugepages() const { return hugetlb_; }
  bool mlocked() const { return mlocked_; }
  // The memfd of a shared pool (owned; closed with the pool), -1 for a private one.
  int fd() const { return fd_; }
  bool shared() const { return shared_; }
  const std::string& name() const { return name_; }
  // Fallbacks taken while allocating (huge pages, NUMA, mlock), "" when none.
  const std::string& note() const { return note_; }
  bool contains(uint64_t addr, uint64_t len) const {
    return addr >= address() && len <= capacity_ && addr - address() <= capacity_ - len;
  }
  ExtentAllocator& allocator() { return alloc_; }

 private:
  std::string name_;
  uint64_t capacity_;
  uint8_t* base_ = nullptr;
  uint64_t map_len_ = 0;   // bytes mapped at map_base_
  uint8_t* map_base_ = nullptr;
  int numa_node_ = -1;
  bool hugetlb_ = false;
  bool mlocked_ = false;
  std::string note_;
  int fd_ = -1;
  bool shared_ = false;
  ExtentAllocator alloc_;
  struct AttachTag {};
  HostPool(AttachTag, int fd, uint64_t capacity, bool mlock, std::string name);
  void lock_memory(bool want_mlock);
  void map_shared(bool hugepages);
  void map_fd(const char* what);
};

// NUMA nodes that have memory; {0} when libnuma is not compiled in or not usable.
std::vector<int> numa_nodes();
bool numa_compiled();

}  // namespace kvio
