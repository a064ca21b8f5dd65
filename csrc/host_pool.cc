#include "host_pool.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <vector>

#include "common.h"

#ifdef KVPOOL_HAVE_NUMA
#include <numa.h>
#endif

#ifndef MAP_HUGE_2MB
#define MAP_HUGE_2MB (21 << 26)
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#ifndef MFD_CLOEXEC
#define MFD_CLOEXEC 0x0001U
#endif
#ifndef MFD_HUGETLB
#define MFD_HUGETLB 0x0004U
#endif
#ifndef MFD_HUGE_2MB
#define MFD_HUGE_2MB (21U << 26)
#endif

namespace kvio {
namespace {

std::string pool_label(const std::string& name) { return "host pool '" + name + "'"; }

uint64_t free_hugepages_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  uint64_t value = 0, free_pages = 0, page_kb = 2048;
  while (f >> key >> value) {
    if (key == "HugePages_Free:") free_pages = value;
    if (key == "Hugepagesize:") page_kb = value;
    f.ignore(256, '\n');
  }
  return page_kb == 2048 ? free_pages * kHugePage : 0;
}

void add_note(std::string& note, const std::string& s) {
  if (!note.empty()) note += "; ";
  note += s;
}

}  // namespace

bool numa_compiled() {
#ifdef KVPOOL_HAVE_NUMA
  return true;
#else
  return false;
#endif
}

std::vector<int> numa_nodes() {
  std::vector<int> nodes;
#ifdef KVPOOL_HAVE_NUMA
  if (numa_available() >= 0) {
    for (int n = 0; n <= numa_max_node(); ++n) {
      long long free_b = 0;
      if (numa_node_size64(n, &free_b) > 0) nodes.push_back(n);
    }
  }
#endif
  if (nodes.empty()) nodes.push_back(0);
  return nodes;
}

HostPool::HostPool(uint64_t capacity, int numa_node, bool hugepages, bool want_mlock,
                   std::string name, bool shared)
    : name_(name.empty() ? (numa_node >= 0 ? "numa" + std::to_string(numa_node) : "host")
                         : std::move(name)),
      capacity_(round_up(capacity, kHugePage)),
      shared_(shared),
      alloc_("host pool", name_, capacity_, 512) {
  if (capacity == 0) {
    throw Error(ErrorKind::Value, name_, -1, EINVAL, pool_label(name_) + ": capacity must be > 0");
  }
  if (numa_node >= 0) {
    const auto nodes = numa_nodes();
    bool known = false;
    for (int n : nodes) known |= (n == numa_node);
    if (!known) {
      throw Error(ErrorKind::Value, name_, -1, EINVAL,
                  pool_label(name_) + ": numa_node " + std::to_string(numa_node) +
                      " does not exist on this machine");
    }
  }

  if (shared_) {
    map_shared(hugepages);
  } else {
    if (hugepages) {
      const uint64_t avail = free_hugepages_bytes();
      if (avail >= capacity_) {
        void* p = mmap(nullptr, capacity_, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB | MAP_HUGE_2MB, -1, 0);
        if (p != MAP_FAILED) {
          map_base_ = base_ = static_cast<uint8_t*>(p);
          map_len_ = capacity_;
          hugetlb_ = true;
        } else {
          add_note(note_, "MAP_HUGETLB failed (" + errno_text(errno) + "), using THP");
        }
      } else {
        add_note(note_, "huge pages unavailable (/proc/sys/vm/nr_hugepages free " +
                            std::to_string(avail / kHugePage) + " x 2 MiB < " +
                            std::to_string(capacity_ / kHugePage) +
                            " needed), using transparent huge pages");
      }
    }
    if (!base_) {
      // Over-map by 2 MiB and trim so the pool starts on a 2 MiB boundary (THP friendly).
      map_len_ = capacity_ + kHugePage;
      void* p = mmap(nullptr, map_len_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) {
        const int err = errno;
        throw Error(ErrorKind::PoolFull, name_, -1, err,
                    pool_label(name_) + ": cannot map " + std::to_string(capacity_) +
                        " bytes: " + errno_text(err));
      }
      map_base_ = static_cast<uint8_t*>(p);
      base_ = reinterpret_cast<uint8_t*>(round_up(reinterpret_cast<uint64_t>(p), kHugePage));
      const uint64_t head = base_ - map_base_;
      if (head) munmap(map_base_, head);
      const uint64_t tail = map_len_ - head - capacity_;
      if (tail) munmap(base_ + capacity_, tail);
      map_base_ = base_;
      map_len_ = capacity_;
      if (hugepages) madvise(base_, capacity_, MADV_HUGEPAGE);
    }
  }

  // Bind before the first touch so pages are faulted on the requested node.
  if (numa_node >= 0) {
#ifdef KVPOOL_HAVE_NUMA
    if (numa_available() >= 0) {
      numa_tonode_memory(base_, capacity_, numa_node);
      numa_node_ = numa_node;
    } else {
      add_note(note_, "libnuma reports NUMA unavailable; memory not bound to node " +
                          std::to_string(numa_node));
    }
#else
    add_note(note_, "built without libnuma; memory not bound to node " + std::to_string(numa_node));
#endif
  }

  // Pre-fault now so the first I/O does not pay for page faults.
  if (madvise(base_, capacity_, MADV_POPULATE_WRITE) != 0) {
    for (uint64_t off = 0; off < capacity_; off += 4096) base_[off] = 0;
  }

  lock_memory(want_mlock);
}

void HostPool::map_shared(bool hugepages) {
  // hugetlbfs-backed when enough 2 MiB pages are free, else shmem (THP when the kernel's
  // shmem_enabled allows it). MFD_CLOEXEC: the fd reaches other processes only by SCM_RIGHTS.
  const std::string label = "kvpool-" + name_;
  if (hugepages && free_hugepages_bytes() >= capacity_) {
    fd_ = memfd_create(label.c_str(), MFD_CLOEXEC | MFD_HUGETLB | MFD_HUGE_2MB);
    if (fd_ >= 0 && ftruncate(fd_, static_cast<off_t>(capacity_)) != 0) {
      add_note(note_, "hugetlb memfd of " + std::to_string(capacity_) + " bytes failed (" +
                          errno_text(errno) + "), using shmem");
      close(fd_);
      fd_ = -1;
    }
    hugetlb_ = fd_ >= 0;
  } else if (hugepages) {
    add_note(note_, "huge pages unavailable for a shared pool, using shmem");
  }
  if (fd_ < 0) fd_ = memfd_create(label.c_str(), MFD_CLOEXEC);
  if (fd_ < 0 || (!hugetlb_ && ftruncate(fd_, static_cast<off_t>(capacity_)) != 0)) {
    const int err = errno;
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
    throw Error(ErrorKind::PoolFull, name_, -1, err,
                pool_label(name_) + ": cannot create a shared memfd of " +
                    std::to_string(capacity_) + " bytes: " + errno_text(err));
  }
  fchmod(fd_, 0600);
  map_fd("its shared memfd");
  if (hugepages && !hugetlb_) madvise(base_, capacity_, MADV_HUGEPAGE);
}

std::shared_ptr<HostPool> HostPool::attach(int fd, uint64_t capacity, bool mlock,
                                           std::string name) {
  return std::shared_ptr<HostPool>(new HostPool(AttachTag{}, fd, capacity, mlock, std::move(name)));
}

HostPool::HostPool(AttachTag, int fd, uint64_t capacity, bool want_mlock, std::string name)
    : name_(name.empty() ? "host" : std::move(name)),
      capacity_(capacity),
      shared_(true),
      alloc_("host pool", name_, capacity == 0 ? 1 : capacity, 512) {
  struct stat st {};
  if (capacity == 0 || fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < capacity) {
    throw Error(ErrorKind::Value, name_, -1, EINVAL,
                pool_label(name_) + ": fd " + std::to_string(fd) + " is not a shared pool of " +
                    std::to_string(capacity) + " bytes");
  }
  fd_ = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (fd_ < 0) {
    const int err = errno;
    throw Error(ErrorKind::Value, name_, -1, err, pool_label(name_) + ": dup: " + errno_text(err));
  }
  map_fd("the shared pool");
  // Fault the page tables in without writing: the bytes belong to the pool service.
  madvise(base_, capacity_, MADV_POPULATE_READ);
  lock_memory(want_mlock);
}

// Maps capacity_ bytes of fd_ shared; on failure closes fd_ and names ``what`` it mapped.
void HostPool::map_fd(const char* what) {
  void* p = mmap(nullptr, capacity_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    close(fd_);
    fd_ = -1;
    throw Error(ErrorKind::PoolFull, name_, -1, err,
                pool_label(name_) + ": cannot map " + what + ": " + errno_text(err));
  }
  map_base_ = base_ = static_cast<uint8_t*>(p);
  map_len_ = capacity_;
}

void HostPool::lock_memory(bool want_mlock) {
  if (!want_mlock) return;
  if (::mlock(base_, capacity_) == 0) {
    mlocked_ = true;
  } else {
    add_note(note_, "mlock failed (" + errno_text(errno) + "), pool is not locked");
  }
}

HostPool::~HostPool() {
  if (mlocked_) munlock(base_, capacity_);
  if (map_base_) munmap(map_base_, map_len_);
  if (fd_ >= 0) close(fd_);
}

}  // namespace kvio
