#include "extent_allocator.h"

#include "common.h"

namespace kvio {

ExtentAllocator::ExtentAllocator(std::string kind, std::string owner, uint64_t capacity,
                                 uint64_t granularity)
    : owner_(std::move(owner)), label_(kind + " '" + owner_ + "'"), granularity_(granularity) {
  if (!is_pow2(granularity)) {
    throw Error(ErrorKind::Value, owner_, -1, EINVAL,
                label_ + ": allocator granularity " + std::to_string(granularity) + " is not a power of two");
  }
  capacity_ = capacity / granularity * granularity;
  if (capacity_) insert_free(0, capacity_);
}

void ExtentAllocator::insert_free(uint64_t offset, uint64_t size) {
  free_by_offset_.emplace(offset, size);
  free_by_size_.emplace(size, offset);
}

void ExtentAllocator::erase_free(std::map<uint64_t, uint64_t>::iterator it) {
  free_by_size_.erase({it->second, it->first});
  free_by_offset_.erase(it);
}

uint64_t ExtentAllocator::alloc(uint64_t nbytes, uint64_t alignment) {
  if (alignment == 0) alignment = granularity_;
  if (!is_pow2(alignment) || alignment < granularity_) {
    throw Error(ErrorKind::Value, owner_, -1, EINVAL,
                label_ + ": alignment " + std::to_string(alignment) +
                    " must be a power of two >= " + std::to_string(granularity_));
  }
  if (nbytes == 0) throw Error(ErrorKind::Value, owner_, -1, EINVAL, label_ + ": cannot allocate 0 bytes");
  const uint64_t size = round_up(nbytes, alignment);
  std::lock_guard<std::mutex> lock(mu_);
  // Best fit: smallest free extent that holds `size` after aligning its start.
  for (auto it = free_by_size_.lower_bound({size, 0}); it != free_by_size_.end(); ++it) {
    const uint64_t ext_size = it->first, ext_off = it->second;
    const uint64_t start = round_up(ext_off, alignment);
    if (start + size > ext_off + ext_size) continue;
    erase_free(free_by_offset_.find(ext_off));
    if (start > ext_off) insert_free(ext_off, start - ext_off);
    if (start + size < ext_off + ext_size) insert_free(start + size, ext_off + ext_size - start - size);
    used_.emplace(start, size);
    used_bytes_ += size;
    return start;
  }
  const uint64_t free_now = capacity_ - used_bytes_;
  throw Error(ErrorKind::PoolFull, owner_, -1, ENOSPC,
              label_ + ": no free extent of " + std::to_string(size) +
                  " bytes (free " + std::to_string(free_now) + " of " +
                  std::to_string(capacity_) + " bytes, largest free extent " +
                  std::to_string(free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first) + ")");
}

void ExtentAllocator::free(uint64_t offset) {
  std::lock_guard<std::mutex> lock(mu_);
  auto u = used_.find(offset);
  if (u == used_.end()) {
    throw Error(ErrorKind::Value, owner_, static_cast<int64_t>(offset), EINVAL,
                label_ + ": offset " + std::to_string(offset) +
                    " is not an allocated extent");
  }
  uint64_t start = u->first, size = u->second;
  used_bytes_ -= size;
  used_.erase(u);
  auto next = free_by_offset_.lower_bound(start);
  if (next != free_by_offset_.end() && next->first == start + size) {
    size += next->second;
    erase_free(next);
  }
  auto after = free_by_offset_.lower_bound(start);
  if (after != free_by_offset_.begin()) {
    auto prev = std::prev(after);
    if (prev->first + prev->second == start) {
      start = prev->first;
      size += prev->second;
      erase_free(prev);
    }
  }
  insert_free(start, size);
}

uint64_t ExtentAllocator::size_of(uint64_t offset) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto u = used_.find(offset);
  return u == used_.end() ? 0 : u->second;
}

uint64_t ExtentAllocator::used_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return used_bytes_;
}

uint64_t ExtentAllocator::free_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return capacity_ - used_bytes_;
}

uint64_t ExtentAllocator::largest_free() const {
  std::lock_guard<std::mutex> lock(mu_);
  return free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first;
}

size_t ExtentAllocator::allocations() const {
  std::lock_guard<std::mutex> lock(mu_);
  return used_.size();
}

}  // namespace kvio
