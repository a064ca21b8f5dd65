// A host memory pool: one 2 MiB-aligned region (per NUMA node), huge pages when possible,
// optionally mlocked, carved into extents for staging KV chunks.
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
  HostPool(uint64_t capacity, int numa_node, bool hugepages, bool mlock, std::string name);
  ~HostPool();
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  uint8_t* data() const { return base_; }
  uint64_t address() const { return reinterpret_cast<uint64_t>(base_); }
  uint64_t capacity() const { return capacity_; }
  int numa_node() const { return numa_node_; }
  bool hugepages() const { return hugetlb_; }
  bool mlocked() const { return mlocked_; }
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
  ExtentAllocator alloc_;
};

// NUMA nodes that have memory; {0} when libnuma is not compiled in or not usable.
std::vector<int> numa_nodes();
bool numa_compiled();

}  // namespace kvio
