#include "device.h"

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>

#include "checksum.h"
#include "common.h"
#ifdef KVPOOL_FAULT_INJECTION
#include "fault.h"
#else
#include "log.h"
#endif

namespace kvio {
namespace {

std::string hex64(uint64_t v) {
  char b[24];
  std::snprintf(b, sizeof(b), "0x%016" PRIx64, v);
  return b;
}

// The backend `make` builds; a fault-injection build puts the fault wrapper in front of it.
template <typename Make>
std::unique_ptr<Backend> make_backend(const BackendOptions& opts, Make&& make) {
#ifdef KVPOOL_FAULT_INJECTION
  return with_faults(opts, make);
#else
  return make(opts);
#endif
}

#ifndef KVPOOL_FAULT_INJECTION
// A user build ignores KVPOOL_FAULTS, once said.
void warn_faults_ignored() {
  static std::atomic<bool> warned{false};
  const char* env = std::getenv("KVPOOL_FAULTS");
  if (!env || !*env || warned.exchange(true)) return;
  engine_log(kLogWarning, "KVPOOL_FAULTS",
             "KVPOOL_FAULTS is set but this build has no fault injection "
             "(-DKVPOOL_FAULT_INJECTION=ON, test builds only): ignored");
}
#endif

}  // namespace

std::vector<std::string> compiled_backends() {
  std::vector<std::string> names{"posix", "uring"};
#ifdef KVPOOL_HAVE_SPDK
  names.push_back("spdk");
#endif
  return names;
}

Device::Device(const DeviceOptions& opts) : opts_(opts) {
  name_ = opts_.name.empty() ? opts_.path : opts_.name;
  if (opts_.queue_depth == 0 || opts_.queue_depth > 4096) {
    throw Error(ErrorKind::Value, name_, -1, EINVAL,
                "device '" + name_ + "': queue_depth must be in 1..4096, got " +
                    std::to_string(opts_.queue_depth));
  }
  const auto names = compiled_backends();
  bool known = false;
  for (const auto& n : names) known |= (n == opts_.backend);
  if (!known) {
    std::string list;
    for (const auto& n : names) list += (list.empty() ? "" : ", ") + n;
    throw Error(ErrorKind::Value, name_, -1, EINVAL,
                "device '" + name_ + "': backend '" + opts_.backend +
                    "' is not compiled into this build (available: " + list + ")");
  }

  BackendOptions bo;
  bo.device = name_;
  bo.queue_depth = opts_.queue_depth;
  bo.sqpoll = opts_.sqpoll;
  bo.threads = opts_.threads;
  bo.core_mask = opts_.spdk_core_mask;
  bo.complete = [this](Request* r, int err, const std::string& detail) {
    on_complete(r, err, detail);
  };
#ifdef KVPOOL_FAULT_INJECTION
  load_env_faults();  // a subprocess (kvpool serve) gets its rules from the environment
#else
  warn_faults_ignored();
#endif

  if (opts_.backend == "spdk") {
#ifdef KVPOOL_HAVE_SPDK
    SpdkGeometry geo;
    backend_ = make_backend(bo, [&](const BackendOptions& o) {
      return make_spdk_backend(o, opts_.path, &geo);
    });
    kind_ = "spdk";
    align_ = geo.sector_size;
    mem_align_ = 4;  // NVMe PRP/SGL entries need dword-aligned payloads
    max_transfer_ = geo.max_transfer;
    if (opts_.capacity > geo.capacity) {
      throw Error(ErrorKind::Value, name_, -1, EINVAL,
                  "device '" + name_ + "': capacity " + std::to_string(opts_.capacity) +
                      " exceeds the namespace size " + std::to_string(geo.capacity));
    }
    capacity_ = opts_.capacity ? opts_.capacity : geo.capacity;
#endif
  } else {
    open_fd_device();
    bo.fd = fd_;
    try {
      backend_ = make_backend(bo, opts_.backend == "uring" ? make_uring_backend
                                                           : make_posix_backend);
    } catch (...) {
      ::close(fd_);
      throw;
    }
  }
  const uint64_t gran = std::max<uint64_t>(align_, 4096);
  capacity_ = capacity_ / gran * gran;
  alloc_ = std::make_unique<ExtentAllocator>("device", name_, capacity_, gran);
}

void Device::open_fd_device() {
  const std::string& path = opts_.path;
  struct stat st {};
  bool created = false;
  const bool direct = opts_.backend == "uring";
  int flags = O_RDWR | O_CLOEXEC | (direct ? O_DIRECT : 0);
  if (::stat(path.c_str(), &st) == 0) {
    if (S_ISBLK(st.st_mode)) {
      kind_ = "block";
    } else if (S_ISREG(st.st_mode)) {
      kind_ = "file";
    } else {
      throw Error(ErrorKind::Value, name_, -1, EINVAL,
                  "device '" + name_ + "': '" + path + "' is neither a block device nor a file");
    }
  } else {
    if (errno != ENOENT || !opts_.create) throw_errno(name_, "open", -1, 0, errno);
    if (opts_.capacity == 0) {
      throw Error(ErrorKind::Value, name_, -1, EINVAL,
                  "device '" + name_ + "': '" + path + "' does not exist and capacity is 0");
    }
    kind_ = "file";
    flags |= O_CREAT | O_EXCL;
    created = true;
  }
  fd_ = ::open(path.c_str(), flags, 0644);
  if (fd_ < 0 && errno == EEXIST && created) {
    // Another process created the file between our stat and open (the ranks of one engine
    // that share a file, e.g. an MLA layout stored once): open it as the existing file it is,
    // and never unlink it on a later failure.
    created = false;
    flags &= ~(O_CREAT | O_EXCL);
    if (::stat(path.c_str(), &st) != 0) throw_errno(name_, "open", -1, 0, errno);
    fd_ = ::open(path.c_str(), flags, 0644);
  }
  if (fd_ < 0) {
    const int err = errno;
    if (err == EINVAL && direct) {
      throw Error(ErrorKind::Io, name_, -1, err,
                  "device '" + name_ + "': the filesystem of '" + path +
                      "' does not support O_DIRECT; use backend='posix'");
    }
    throw_errno(name_, "open", -1, 0, err);
  }
  auto fail = [&](const char* what, int err) {
    ::close(fd_);
    fd_ = -1;
    if (created) ::unlink(path.c_str());
    throw_errno(name_, what, -1, opts_.capacity, err);
  };

  if (kind_ == "block") {
    uint64_t size = 0;
    if (ioctl(fd_, BLKGETSIZE64, &size) != 0) fail("BLKGETSIZE64", errno);
    if (opts_.capacity > size) {
      ::close(fd_);
      throw Error(ErrorKind::Value, name_, -1, EINVAL,
                  "device '" + name_ + "': capacity " + std::to_string(opts_.capacity) +
                      " exceeds the block device size " + std::to_string(size));
    }
    capacity_ = opts_.capacity ? opts_.capacity : size;
  } else {
    const uint64_t size = created ? 0 : static_cast<uint64_t>(st.st_size);
    if (opts_.capacity > size) {
      // Preallocate so later writes never hit ENOSPC halfway through a chunk.
      if (fallocate(fd_, 0, 0, static_cast<off_t>(opts_.capacity)) != 0) {
        const int err = errno;
        if (err != EOPNOTSUPP) fail("fallocate", err);
        if (ftruncate(fd_, static_cast<off_t>(opts_.capacity)) != 0) fail("ftruncate", errno);
        note_ = "fallocate unsupported by the filesystem; file extended with ftruncate";
      }
    }
    capacity_ = opts_.capacity ? opts_.capacity : size;
    if (capacity_ == 0) {
      ::close(fd_);
      throw Error(ErrorKind::Value, name_, -1, EINVAL,
                  "device '" + name_ + "': '" + path + "' is empty and capacity is 0");
    }
  }

  if (!direct) {
    align_ = mem_align_ = 1;
    return;
  }
  struct statx stx {};
  if (statx(fd_, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx) == 0 && (stx.stx_mask & STATX_DIOALIGN) &&
      stx.stx_dio_offset_align > 0) {
    align_ = stx.stx_dio_offset_align;
    mem_align_ = std::max<uint32_t>(stx.stx_dio_mem_align, 1);
    return;
  }
  int lbs = 0;
  if (kind_ == "block" && ioctl(fd_, BLKSSZGET, &lbs) == 0 && lbs > 0) {
    align_ = mem_align_ = static_cast<uint64_t>(lbs);
  } else {
    align_ = mem_align_ = 4096;  // safe for every filesystem that takes O_DIRECT
  }
}

Device::~Device() {
  try {
    close();
  } catch (...) {
  }
}

bool Device::sqpoll() const { return backend_ && backend_->sqpoll(); }

std::string Device::state() const {
  return closed_ ? "closed" : backend_->state();
}

std::string Device::note() const {
  std::string n = note_;
  if (backend_) {
    const std::string b = backend_->note();
    if (!b.empty()) n += (n.empty() ? "" : "; ") + b;
  }
  return n;
}

void Device::register_host_pools(const std::vector<std::shared_ptr<HostPool>>& pools) {
  if (closed_) throw_errno(name_, "register_host_pools", -1, 0, EBADF);
  std::vector<Region> regions;
  for (const auto& p : pools) {
    if (backend_->needs_hugetlb() && !p->hugepages()) {
      throw Error(ErrorKind::Value, name_, -1, EINVAL,
                  "device '" + name_ + "': host pool '" + p->name() +
                      "' is not backed by hugetlb pages (" +
                      (p->note().empty() ? std::string("hugepages=False") : p->note()) +
                      "); SPDK over PCIe DMAs to physical addresses and transparent huge "
                      "pages can move under it: reserve huge pages (/proc/sys/vm/nr_hugepages) "
                      "or use an NVMe-oF transport (TCP/RDMA), which accepts such pools");
    }
    regions.push_back({p->address(), p->capacity()});
  }
  backend_->register_regions(regions);
  std::lock_guard<std::mutex> l(mu_);
  pools_ = pools;
}

void Device::check_op(bool write, const IoOp& op) const {
  const char* what = write ? "write" : "read";
  const auto off = static_cast<int64_t>(op.offset);
  auto misaligned = [&](const std::string& detail) {
    throw Error(ErrorKind::Alignment, name_, off, EINVAL,
                describe(name_, what, off, op.length, detail));
  };
  if (op.length == 0) misaligned("length is 0");
  if (op.offset % align_) misaligned("offset is not a multiple of " + std::to_string(align_));
  if (op.length % align_) misaligned("length is not a multiple of " + std::to_string(align_));
  auto check_host = [&](uint64_t addr, const std::string& which) {
    if (addr % mem_align_) {
      misaligned(which + "host address " + hex64(addr) + " is not a multiple of " +
                 std::to_string(mem_align_));
    }
  };
  if (op.segments.empty()) {
    check_host(op.addr, "");
  } else {
    uint64_t sum = 0;
    for (size_t i = 0; i < op.segments.size(); ++i) {
      const Region& seg = op.segments[i];
      const std::string which = "segment " + std::to_string(i) + ": ";
      check_host(seg.addr, which);
      if (seg.length == 0 || seg.length % align_) {
        misaligned(which + "length " + std::to_string(seg.length) + " is not a positive multiple of " +
                   std::to_string(align_));
      }
      sum += seg.length;
    }
    if (sum != op.length) {
      misaligned("segments hold " + std::to_string(sum) + " bytes, the op says " +
                 std::to_string(op.length));
    }
  }
  if (op.length > (1ull << 31)) misaligned("length exceeds 2 GiB per op");
  if (op.offset > capacity_ || op.length > capacity_ - op.offset) {
    const int err = write ? ENOSPC : EINVAL;
    throw Error(ErrorKind::Io, name_, off, err,
                describe(name_, what, off, op.length,
                         "range ends past the device capacity " + std::to_string(capacity_) +
                             " (" + errno_text(err) + ")"));
  }
}

uint64_t Device::submit(bool write, const std::vector<IoOp>& ops) {
  if (closed_) throw_errno(name_, write ? "write" : "read", -1, 0, EBADF);
  for (const IoOp& op : ops) check_op(write, op);
  const std::string st = backend_->state();
  if (st != "ok") {
    const int err = st == "reconnecting" ? ENOTCONN : ENODEV;
    throw Error(ErrorKind::Unavailable, name_, -1, err,
                "device '" + name_ + "': " + (write ? "write" : "read") + ": device is " + st +
                    " (" + std::to_string(backend_->reconnects()) +
                    " reconnects so far; its chunks are unavailable until it recovers)");
  }
  auto t = std::make_shared<Ticket>();
  const size_t n = ops.size();
  t->results.resize(n);
  t->expected.resize(n);
  t->first_req.resize(n + 1);
  t->op_remaining = std::make_unique<std::atomic<uint32_t>[]>(n);
  size_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    t->first_req[i] = total;
    total += ops[i].segments.empty() ? 1 : ops[i].segments.size();
  }
  t->first_req[n] = total;
  t->reqs.resize(total);
  for (size_t i = 0; i < n; ++i) {
    const IoOp& op = ops[i];
    const std::vector<Region> one{{op.addr, op.length}};
    const std::vector<Region>& parts = op.segments.empty() ? one : op.segments;
    // The checksum of a write describes the bytes handed to us, computed before they move.
    Xxh3 hash;
    uint64_t dev_off = op.offset;
    for (size_t k = 0; k < parts.size(); ++k) {
      Request& r = t->reqs[t->first_req[i] + k];
      r.offset = dev_off;
      r.addr = parts[k].addr;
      r.length = parts[k].length;
      r.write = write;
      r.ticket = t.get();
      r.index = static_cast<uint32_t>(i);
      dev_off += parts[k].length;
      if (write) hash.update(reinterpret_cast<const void*>(r.addr), r.length);
    }
    IoResult& res = t->results[i];
    res.index = static_cast<uint32_t>(i);
    res.offset = op.offset;
    res.length = op.length;
    if (write) res.checksum = hash.digest();
    t->expected[i] = write ? std::nullopt : op.expected;
    t->op_remaining[i] = static_cast<uint32_t>(parts.size());
  }
  t->remaining = total;
  t->done = (total == 0);
  std::vector<Request*> ptrs;
  ptrs.reserve(total);
  for (auto& r : t->reqs) ptrs.push_back(&r);
  std::lock_guard<std::mutex> l(mu_);
  if (closed_) throw_errno(name_, write ? "write" : "read", -1, 0, EBADF);
  const uint64_t id = next_ticket_++;
  tickets_.emplace(id, t);
  if (total) backend_->submit(ptrs);
  return id;
}

void Device::on_complete(Request* r, int err, const std::string& detail) {
  Ticket* t = r->ticket;
  IoResult& res = t->results[r->index];
  if (err) {
    const std::lock_guard<std::mutex> l(t->mu);  // segments of one op may fail concurrently
    if (res.status != Status::Error) {
      res.status = Status::Error;
      res.err = err;
      res.checksum = 0;
      res.message = describe(name_, r->write ? "write" : "read", static_cast<int64_t>(r->offset),
                             r->length,
                             detail.empty() ? errno_text(err)
                                            : detail + " (" + errno_text(err) + ")");
      ++errors_;
    }
  } else if (r->write) {
    bytes_written_ += r->length;
  } else {
    bytes_read_ += r->length;
  }
  if (t->op_remaining[r->index].fetch_sub(1) == 1) finish_op(t, r->index);
  if (t->remaining.fetch_sub(1) == 1) {
    std::lock_guard<std::mutex> l(t->mu);
    t->done = true;
    t->cv.notify_all();
  }
}

// Runs once per op, after all its requests completed: counts it and verifies a read.
void Device::finish_op(Ticket* t, uint32_t op) {
  IoResult& res = t->results[op];
  if (res.status == Status::Error) return;
  const Request* first = &t->reqs[t->first_req[op]];
  if (first->write) {
    ++writes_;
    return;
  }
  ++reads_;
  const auto& want = t->expected[op];
  if (!want) return;
  Xxh3 hash;
  for (size_t k = t->first_req[op]; k < t->first_req[op + 1]; ++k) {
    hash.update(reinterpret_cast<const void*>(t->reqs[k].addr), t->reqs[k].length);
  }
  res.checksum = hash.digest();
  if (res.checksum != *want) {
    res.status = Status::Corrupt;
    res.err = EBADMSG;
    res.message = describe(name_, "read", static_cast<int64_t>(res.offset), res.length,
                           "checksum mismatch (expected " + hex64(*want) + ", read " +
                               hex64(res.checksum) + "): chunk is corrupt");
    ++corrupt_;
  }
}

std::shared_ptr<Ticket> Device::find(uint64_t ticket) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = tickets_.find(ticket);
  if (it == tickets_.end()) {
    throw Error(ErrorKind::Value, name_, -1, EINVAL,
                "device '" + name_ + "': unknown or already waited ticket " +
                    std::to_string(ticket));
  }
  return it->second;
}

bool Device::poll(uint64_t ticket) { return find(ticket)->remaining.load() == 0; }

bool Device::wait(uint64_t ticket, double timeout_s, std::vector<IoResult>* out) {
  auto t = find(ticket);
  {
    std::unique_lock<std::mutex> l(t->mu);
    if (timeout_s < 0) {
      t->cv.wait(l, [&] { return t->done; });
    } else if (!t->cv.wait_for(l, std::chrono::duration<double>(timeout_s),
                               [&] { return t->done; })) {
      return false;
    }
  }
  {
    std::lock_guard<std::mutex> l(mu_);
    tickets_.erase(ticket);
  }
  *out = std::move(t->results);
  return true;
}

DeviceStats Device::stats() const {
  return {bytes_read_.load(), bytes_written_.load(), reads_.load(), writes_.load(),
          errors_.load(),     corrupt_.load(),       backend_ ? backend_->inflight() : 0,
          backend_ ? backend_->reconnects() : 0};
}

void Device::close() {
  std::lock_guard<std::mutex> c(close_mu_);
  {
    std::lock_guard<std::mutex> l(mu_);
    if (closed_) return;
    closed_ = true;
  }
  if (backend_) backend_->shutdown();  // completes everything queued first
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

}  // namespace kvio
