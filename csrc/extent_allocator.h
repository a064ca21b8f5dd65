// Best-fit extent allocator over [0, capacity) with coalescing frees; used for host pools and
// for device space. Thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <utility>

namespace kvio {

class ExtentAllocator {
 public:
  // `granularity` (power of two): every allocation starts and ends on a multiple of it.
  // `kind` + `owner` name the allocator in errors ("device '/dev/loop0'", "host pool 'numa0'").
  ExtentAllocator(std::string kind, std::string owner, uint64_t capacity, uint64_t granularity);

  // Returns the offset of `nbytes` (rounded up to max(granularity, alignment)) aligned to
  // `alignment` (power of two, >= granularity). Throws Error(PoolFull) when nothing fits.
  uint64_t alloc(uint64_t nbytes, uint64_t alignment = 0);
  // Throws Error(Value) if `offset` is not the start of a live allocation.
  void free(uint64_t offset);
  // Size of the allocation at `offset`, 0 if none.
  uint64_t size_of(uint64_t offset) const;

  uint64_t capacity() const { return capacity_; }
  uint64_t granularity() const { return granularity_; }
  uint64_t used_bytes() const;
  uint64_t free_bytes() const;
  uint64_t largest_free() const;
  size_t allocations() const;

 private:
  void insert_free(uint64_t offset, uint64_t size);
  void erase_free(std::map<uint64_t, uint64_t>::iterator it);

  std::string owner_;
  std::string label_;
  uint64_t capacity_;
  uint64_t granularity_;
  mutable std::mutex mu_;
  std::map<uint64_t, uint64_t> free_by_offset_;            // offset -> size
  std::set<std::pair<uint64_t, uint64_t>> free_by_size_;   // (size, offset)
  std::map<uint64_t, uint64_t> used_;                      // offset -> size
  uint64_t used_bytes_ = 0;
};

}  // namespace kvio
