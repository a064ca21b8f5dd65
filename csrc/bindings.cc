// pybind11 module vllm_kvpool._kvio: the Python face of the I/O engine (see csrc/API.md).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <set>

#include "backend.h"
#include "checksum.h"
#include "common.h"
#include "copy.h"
#include "device.h"
#ifdef KVPOOL_FAULT_INJECTION
#include "fault.h"
#endif
#include "host_pool.h"
#include "log.h"
#include "probe.h"

namespace py = pybind11;
using namespace kvio;

#ifndef KVPOOL_VERSION
#define KVPOOL_VERSION "0.0.0"
#endif
#ifndef KVPOOL_LIBURING_VERSION
#define KVPOOL_LIBURING_VERSION "unknown"
#endif
#ifndef KVPOOL_SPDK_VERSION
#define KVPOOL_SPDK_VERSION ""
#endif
#ifdef KVPOOL_FAULT_INJECTION
constexpr bool fault_injection_compiled = true;
#else
constexpr bool fault_injection_compiled = false;
#endif

namespace {

// Exception classes, created at import (see PYBIND11_MODULE below).
struct ErrorClasses {
  py::object kvio, alignment, pool_full, corrupt, unavailable;
};
ErrorClasses* g_errors = nullptr;

py::object error_class(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::Alignment: return g_errors->alignment;
    case ErrorKind::PoolFull: return g_errors->pool_full;
    case ErrorKind::Corrupt: return g_errors->corrupt;
    case ErrorKind::Unavailable: return g_errors->unavailable;
    default: return g_errors->kvio;
  }
}

// Sets the Python error: KvioError(errno, message) with .device/.offset/.results.
void set_error(ErrorKind kind, const std::string& device, int64_t offset, int err,
               const std::string& message, py::object results = py::none()) {
  py::object cls = error_class(kind);
  py::object exc = cls(err, message);
  exc.attr("device") = device;
  exc.attr("offset") = offset;
  exc.attr("results") = results;
  PyErr_SetObject(cls.ptr(), exc.ptr());
}

// Logs a fallback once per kind at WARNING (later pools/devices with the same reason at DEBUG,
// so a pool of many devices does not repeat itself). Called with the GIL held.
void log_note(const std::string& what, const std::string& note) {
  if (note.empty()) return;
  static std::set<std::string> seen;
  std::string key;
  for (char ch : note) {
    if (ch < '0' || ch > '9') key += ch;  // sizes differ between pools; the reason does not
  }
  const char* level = seen.insert(key).second ? "warning" : "debug";
  py::module_::import("logging").attr("getLogger")("vllm_kvpool.kvio").attr(level)(
      "%s: %s", what, note);
}

// Moves queued engine log records (SPDK's log, reconnects) into Python logging. Called with the
// GIL held on the way out of device calls; engine threads never take the GIL themselves.
void flush_engine_log() {
  if (!engine_log_pending()) return;
  const auto records = drain_engine_log();
  if (records.empty()) return;
  py::object logger = py::module_::import("logging").attr("getLogger")("vllm_kvpool.kvio");
  for (const auto& r : records) logger.attr("log")(r.level, "%s", r.message);
}

const char* status_name(Status s) {
  switch (s) {
    case Status::Ok: return "ok";
    case Status::Corrupt: return "corrupt";
    default: return "error";
  }
}

// A contiguous Python buffer held for the duration of a call.
class BufferView {
 public:
  BufferView(py::handle obj, int flags) {
    if (PyObject_GetBuffer(obj.ptr(), &view_, flags) != 0) throw py::error_already_set();
  }
  ~BufferView() { PyBuffer_Release(&view_); }
  const Py_buffer& operator*() const { return view_; }

 private:
  Py_buffer view_{};
};

uint64_t to_u64(py::handle h, const char* field, size_t index) {
  if (!py::isinstance<py::int_>(h)) {
    throw py::type_error("op " + std::to_string(index) + ": " + field + " must be an int, got " +
                         std::string(py::str(py::type::handle_of(h).attr("__name__"))));
  }
  return h.cast<uint64_t>();
}

// Rows of `cols` 64-bit integers: a C-contiguous (N, cols) integer buffer (numpy) or a sequence
// of tuples. `what` names the rows in errors, `fields` the columns.
std::vector<uint64_t> parse_rows(py::handle obj, size_t cols, const std::string& what,
                                 const std::vector<const char*>& fields) {
  std::vector<uint64_t> out;
  if (PyObject_CheckBuffer(obj.ptr())) {
    BufferView b(obj, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT);
    const Py_buffer& v = *b;
    const std::string fmt = v.format ? v.format : "B";
    const char code = fmt.empty() ? 'B' : fmt.back();
    const bool int64 = v.itemsize == 8 && std::string("QLqlNn").find(code) != std::string::npos;
    if (!int64 || v.ndim != 2 || v.shape[1] != static_cast<Py_ssize_t>(cols)) {
      throw py::type_error(what + ": a buffer must be C-contiguous 64-bit integers of shape (N, " +
                           std::to_string(cols) + ")");
    }
    const auto* rows = static_cast<const uint64_t*>(v.buf);
    out.assign(rows, rows + v.shape[0] * cols);
    return out;
  }
  size_t i = 0;
  for (py::handle item : obj) {
    py::sequence t = py::reinterpret_borrow<py::sequence>(item);
    if (!py::isinstance<py::sequence>(item) || t.size() != cols) {
      std::string names;
      for (const char* f : fields) names += std::string(names.empty() ? "" : ", ") + f;
      throw py::type_error(what + " " + std::to_string(i) + ": expected (" + names + ")");
    }
    for (size_t c = 0; c < cols; ++c) out.push_back(to_u64(t[c], fields[c], i));
    ++i;
  }
  return out;
}

std::vector<IoOp> parse_ops(py::handle ops, bool write) {
  std::vector<IoOp> out;
  const size_t want_max = write ? 3 : 4;
  size_t i = 0;
  for (py::handle item : ops) {
    py::sequence t = py::reinterpret_borrow<py::sequence>(item);
    if (!py::isinstance<py::sequence>(item) || t.size() < 3 || t.size() > want_max) {
      throw py::type_error("op " + std::to_string(i) + ": expected a tuple (dev_offset, host_addr "
                           "or segments, length" + std::string(write ? ")" : "[, expected_checksum])"));
    }
    IoOp op;
    op.offset = to_u64(t[0], "dev_offset", i);
    if (py::isinstance<py::int_>(t[1])) {
      op.addr = to_u64(t[1], "host_addr", i);
    } else {
      const auto flat = parse_rows(t[1], 2, "op " + std::to_string(i) + " segment",
                                   {"host_addr", "length"});
      for (size_t k = 0; k < flat.size(); k += 2) op.segments.push_back({flat[k], flat[k + 1]});
      if (op.segments.empty()) {
        throw py::value_error("op " + std::to_string(i) + ": segments is empty");
      }
    }
    op.length = to_u64(t[2], "length", i);
    if (t.size() == 4 && !t[3].is_none()) op.expected = to_u64(t[3], "expected_checksum", i);
    out.push_back(std::move(op));
    ++i;
  }
  return out;
}

std::vector<CopyOp> parse_copy_ops(py::handle ops) {
  const auto flat = parse_rows(ops, 3, "copy op", {"dst_addr", "src_addr", "nbytes"});
  std::vector<CopyOp> out;
  out.reserve(flat.size() / 3);
  for (size_t k = 0; k < flat.size(); k += 3) out.push_back({flat[k], flat[k + 1], flat[k + 2]});
  return out;
}

py::list results_to_list(std::vector<IoResult>& results) {
  py::list out;
  for (auto& r : results) out.append(py::cast(std::move(r)));
  return out;
}

// Waits with the GIL released, waking every 100 ms so Ctrl-C still works.
py::list wait_ticket(Device& dev, uint64_t ticket, py::object timeout, bool check) {
  const double limit = timeout.is_none() ? -1.0 : timeout.cast<double>();
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<IoResult> results;
  for (;;) {
    double slice = 0.1;
    if (limit >= 0) {
      const double left =
          limit - std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (left <= 0) slice = 0;
      else slice = std::min(slice, left);
    }
    bool done;
    {
      py::gil_scoped_release nogil;
      done = dev.wait(ticket, slice, &results);
    }
    if (done) break;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    if (limit >= 0 && std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() >= limit) {
      PyErr_Format(PyExc_TimeoutError, "device '%s': ticket %llu not finished after %.3f s",
                   dev.name().c_str(), static_cast<unsigned long long>(ticket), limit);
      throw py::error_already_set();
    }
  }
  const IoResult* first_bad = nullptr;
  for (const auto& r : results) {
    if (r.status == Status::Error) {
      first_bad = &r;
      break;
    }
    if (r.status == Status::Corrupt && !first_bad) first_bad = &r;
  }
  flush_engine_log();
  if (!check || !first_bad) return results_to_list(results);
  const ErrorKind kind = first_bad->status == Status::Corrupt ? ErrorKind::Corrupt
                         : unavailable_errno(first_bad->err) ? ErrorKind::Unavailable
                                                             : ErrorKind::Io;
  const int err = first_bad->err;
  const int64_t off = static_cast<int64_t>(first_bad->offset);
  const std::string msg = first_bad->message;
  py::list all = results_to_list(results);
  set_error(kind, dev.name(), off, err, msg, all);
  throw py::error_already_set();
}

uint64_t submit(Device& dev, py::handle ops, bool write) {
  std::vector<IoOp> parsed = parse_ops(ops, write);
  flush_engine_log();
  py::gil_scoped_release nogil;
  return dev.submit(write, parsed);
}

py::dict probe_to_dict(const DeviceProbe& p) {
  py::dict d;
  d["read_gbps"] = p.read_gbps;
  d["write_gbps"] = p.write_gbps;
  d["bytes_read"] = p.bytes_read;
  d["bytes_written"] = p.bytes_written;
  d["seconds"] = p.seconds;
  return d;
}

}  // namespace

PYBIND11_MODULE(_kvio, m) {
  m.doc() = "KV-passthrough I/O engine: host pools, O_DIRECT devices (io_uring / SPDK / POSIX), "
            "checksummed chunk I/O and bandwidth probes. See csrc/API.md.";

  g_errors = new ErrorClasses();  // lives as long as the process (module cannot be unloaded)
  py::object oserror = py::reinterpret_borrow<py::object>(PyExc_OSError);
  auto make = [&](const char* name, py::tuple bases, const char* doc) {
    py::dict ns;
    ns["__doc__"] = doc;
    ns["__module__"] = "vllm_kvpool._kvio";
    py::object cls = py::reinterpret_borrow<py::object>((PyObject*)&PyType_Type)(name, bases, ns);
    m.attr(name) = cls;
    return cls;
  };
  g_errors->kvio = make("KvioError", py::make_tuple(oserror),
                        "I/O engine error. Attributes: device, offset (-1 if n/a), errno, "
                        "strerror, results (list of IoResult when raised by wait()).");
  g_errors->alignment = make(
      "AlignmentError",
      py::make_tuple(g_errors->kvio, py::reinterpret_borrow<py::object>(PyExc_ValueError)),
      "Misaligned device offset, length or host address.");
  g_errors->pool_full = make(
      "PoolFullError",
      py::make_tuple(g_errors->kvio, py::reinterpret_borrow<py::object>(PyExc_MemoryError)),
      "A host pool or device allocator has no free extent large enough.");
  g_errors->corrupt = make("CorruptError", py::make_tuple(g_errors->kvio),
                           "A read chunk did not match its checksum (raised by wait(check=True)).");
  g_errors->unavailable = make(
      "DeviceUnavailableError", py::make_tuple(g_errors->kvio),
      "The device lost its connection (ECONNRESET: in-flight I/O failed), is reconnecting "
      "(ENOTCONN) or is marked failed (ENODEV); Device.state says which. Nothing was returned "
      "as data; retry once Device.state is 'ok' again.");
  // Default attributes so every instance has them even when raised from Python.
  for (py::object* c : {&g_errors->kvio}) {
    c->attr("device") = "";
    c->attr("offset") = -1;
    c->attr("results") = py::none();
  }

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      if (e.kind() == ErrorKind::Value) {
        PyErr_SetString(PyExc_ValueError, e.what());
      } else {
        set_error(e.kind(), e.device(), e.offset(), e.err(), e.what());
      }
    }
  });

  m.def("backends", &compiled_backends, "Backends compiled into this build.");
  m.def("build_info", [] {
    py::dict d;
    d["version"] = KVPOOL_VERSION;
    d["backends"] = compiled_backends();
    d["numa"] = numa_compiled();
    d["liburing"] = KVPOOL_LIBURING_VERSION;
#ifdef KVPOOL_HAVE_SPDK
    d["spdk"] = true;
    d["spdk_version"] = KVPOOL_SPDK_VERSION;
#else
    d["spdk"] = false;
#endif
    d["fault_injection"] = fault_injection_compiled;
    d["compiler"] = __VERSION__;
    return d;
  });
  m.def("fault_injection", [] { return fault_injection_compiled; },
        "Whether this build can inject device faults (KVPOOL_FAULT_INJECTION, test builds).");
  m.def(
      "set_faults",
      [](const std::string& spec) {
#ifdef KVPOOL_FAULT_INJECTION
        set_faults(spec);
#else
        throw std::runtime_error(
            "set_faults: vllm_kvpool._kvio was built without fault injection "
            "(-DKVPOOL_FAULT_INJECTION=ON, test builds only)");
#endif
      },
      py::arg("spec"),
      "Replace the fault rules (KVPOOL_FAULTS syntax; counters restart; \"\" clears).");
  m.def(
      "faults",
      [] {
        py::list out;
#ifdef KVPOOL_FAULT_INJECTION
        for (const FaultRule& r : current_faults()) {
          py::dict d;
          d["device"] = r.device;
          d["op"] = r.write ? "write" : "read";
          d["errno"] = r.err;
          d["after"] = r.after;
          d["count"] = r.count;
          d["seen"] = r.seen;
          d["injected"] = r.injected;
          out.append(d);
        }
#endif
        return out;
      },
      "The fault rules in force with their counters ([] without fault injection).");
  m.def(
      "faults_injected",
      [] {
        uint64_t n = 0;
#ifdef KVPOOL_FAULT_INJECTION
        for (const FaultRule& r : current_faults()) n += r.injected;
#endif
        return n;
      },
      "Requests failed by fault rules so far (0 without fault injection).");
  m.def("numa_nodes", &numa_nodes, "NUMA nodes with memory ([0] without libnuma).");
  m.def("flush_log", &flush_engine_log,
        "Move queued engine log records (SPDK, reconnects) into logger 'vllm_kvpool.kvio' "
        "(also done by every Device call).");

  m.def(
      "checksum",
      [](py::object obj, py::object nbytes, uint64_t seed) -> uint64_t {
        if (py::isinstance<py::int_>(obj)) {
          if (nbytes.is_none()) throw py::value_error("checksum(addr, nbytes): nbytes is required");
          const auto addr = obj.cast<uint64_t>();
          const auto n = nbytes.cast<uint64_t>();
          py::gil_scoped_release nogil;
          return xxh3_64(reinterpret_cast<const void*>(addr), n, seed);
        }
        BufferView b(obj, PyBUF_ANY_CONTIGUOUS);
        uint64_t n = static_cast<uint64_t>((*b).len);
        if (!nbytes.is_none()) {
          const auto want = nbytes.cast<uint64_t>();
          if (want > n) {
            throw py::value_error("checksum: nbytes " + std::to_string(want) +
                                  " exceeds the buffer size " + std::to_string(n));
          }
          n = want;
        }
        const void* data = (*b).buf;
        py::gil_scoped_release nogil;
        return xxh3_64(data, n, seed);
      },
      py::arg("buf_or_addr"), py::arg("nbytes") = py::none(), py::arg("seed") = 0,
      "XXH3-64 (as xxhash.xxh3_64_intdigest) of a buffer or of nbytes at an address (GIL "
      "released).");

  m.def(
      "memcpy",
      [](uint64_t dst, uint64_t src, uint64_t nbytes) {
        py::gil_scoped_release nogil;
        const CopyOp op{dst, src, nbytes};
        copy_many(&op, 1, 1);
      },
      py::arg("dst_addr"), py::arg("src_addr"), py::arg("nbytes"),
      "Copy nbytes from src_addr to dst_addr with the GIL released.");
  m.def(
      "copy_many",
      [](py::handle ops, unsigned threads) {
        std::vector<CopyOp> parsed = parse_copy_ops(ops);
        py::gil_scoped_release nogil;
        return copy_many(parsed.data(), parsed.size(), threads);
      },
      py::arg("ops"), py::arg("threads") = 1,
      "Gather/scatter copy of (dst_addr, src_addr, nbytes) ops (list or uint64 (N,3) buffer).");
  m.def(
      "copy_many_checksum",
      [](py::handle ops) {
        std::vector<CopyOp> parsed = parse_copy_ops(ops);
        py::gil_scoped_release nogil;
        return copy_many_checksum(parsed.data(), parsed.size());
      },
      py::arg("ops"),
      "copy_many on one thread that also returns the XXH3-64 of the source bytes in op order "
      "(verifies a chunk while scattering it: one pass over memory).");

  py::class_<HostPool, std::shared_ptr<HostPool>>(m, "HostPool", py::buffer_protocol())
      .def(py::init([](uint64_t capacity, int numa_node, bool hugepages, bool mlock,
                       std::string name, bool shared) {
             std::shared_ptr<HostPool> p;
             {
               py::gil_scoped_release nogil;
               p = std::make_shared<HostPool>(capacity, numa_node, hugepages, mlock, name,
                                              shared);
             }
             log_note("host pool '" + p->name() + "'", p->note());
             return p;
           }),
           py::arg("capacity"), py::arg("numa_node") = -1, py::arg("hugepages") = true,
           py::arg("mlock") = false, py::arg("name") = "", py::arg("shared") = false)
      .def_static(
          "attach",
          [](int fd, uint64_t capacity, bool mlock, std::string name) {
            std::shared_ptr<HostPool> p;
            {
              py::gil_scoped_release nogil;
              p = HostPool::attach(fd, capacity, mlock, name);
            }
            log_note("host pool '" + p->name() + "'", p->note());
            return p;
          },
          py::arg("fd"), py::arg("capacity"), py::arg("mlock") = false, py::arg("name") = "",
          "Map a shared pool another process created (its memfd, received over a Unix socket).")
      .def_property_readonly("fd", &HostPool::fd)
      .def_property_readonly("shared", &HostPool::shared)
      .def_buffer([](HostPool& p) {
        return py::buffer_info(p.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(p.capacity())}, {1}, false);
      })
      .def_property_readonly("address", &HostPool::address)
      .def_property_readonly("capacity", &HostPool::capacity)
      .def_property_readonly("numa_node", &HostPool::numa_node)
      .def_property_readonly("hugepages", &HostPool::hugepages)
      .def_property_readonly("mlocked", &HostPool::mlocked)
      .def_property_readonly("name", &HostPool::name)
      .def_property_readonly("note", &HostPool::note)
      .def(
          "view",
          [](py::object self, uint64_t offset, uint64_t nbytes) {
            auto& p = self.cast<HostPool&>();
            if (offset > p.capacity() || nbytes > p.capacity() - offset) {
              throw py::value_error("host pool '" + p.name() + "': view [" +
                                    std::to_string(offset) + ", +" + std::to_string(nbytes) +
                                    ") is outside the pool of " + std::to_string(p.capacity()) +
                                    " bytes");
            }
            // Slicing a memoryview of the pool keeps the pool alive as long as the view.
            py::object whole = py::module_::import("builtins").attr("memoryview")(self);
            return whole.attr("__getitem__")(py::slice(offset, offset + nbytes, 1));
          },
          py::arg("offset"), py::arg("nbytes"))
      .def(
          "alloc", [](HostPool& p, uint64_t n, uint64_t a) { return p.allocator().alloc(n, a); },
          py::arg("nbytes"), py::arg("alignment") = 4096)
      .def(
          "free", [](HostPool& p, uint64_t off) { p.allocator().free(off); }, py::arg("offset"))
      .def_property_readonly("used_bytes", [](HostPool& p) { return p.allocator().used_bytes(); })
      .def_property_readonly("free_bytes", [](HostPool& p) { return p.allocator().free_bytes(); })
      .def_property_readonly("largest_free",
                             [](HostPool& p) { return p.allocator().largest_free(); })
      .def_property_readonly("allocations",
                             [](HostPool& p) { return p.allocator().allocations(); })
      .def("__len__", &HostPool::capacity)
      .def("__repr__", [](HostPool& p) {
        return "HostPool(name='" + p.name() + "', capacity=" + std::to_string(p.capacity()) +
               ", numa_node=" + std::to_string(p.numa_node()) +
               ", hugepages=" + (p.hugepages() ? "True" : "False") +
               ", used_bytes=" + std::to_string(p.allocator().used_bytes()) + ")";
      });

  py::class_<IoResult>(m, "IoResult")
      .def_readonly("index", &IoResult::index)
      .def_readonly("offset", &IoResult::offset)
      .def_readonly("length", &IoResult::length)
      .def_property_readonly("status", [](const IoResult& r) { return status_name(r.status); })
      .def_property_readonly("ok", [](const IoResult& r) { return r.status == Status::Ok; })
      .def_readonly("checksum", &IoResult::checksum)
      .def_readonly("errno", &IoResult::err)
      .def_readonly("message", &IoResult::message)
      .def("__repr__", [](const IoResult& r) {
        return "IoResult(index=" + std::to_string(r.index) + ", offset=" +
               std::to_string(r.offset) + ", length=" + std::to_string(r.length) + ", status='" +
               status_name(r.status) + "', errno=" + std::to_string(r.err) + ")";
      });

  py::class_<Device, std::shared_ptr<Device>>(m, "Device")
      .def(py::init([](std::string path, uint64_t capacity, std::string backend,
                       unsigned queue_depth, bool sqpoll, bool create, std::string name,
                       unsigned threads, std::string spdk_core_mask) {
             DeviceOptions o;
             o.path = std::move(path);
             o.capacity = capacity;
             o.backend = std::move(backend);
             o.queue_depth = queue_depth;
             o.sqpoll = sqpoll;
             o.create = create;
             o.name = std::move(name);
             o.threads = threads;
             o.spdk_core_mask = std::move(spdk_core_mask);
             std::shared_ptr<Device> d;
             try {
               py::gil_scoped_release nogil;
               d = std::make_shared<Device>(o);
             } catch (...) {
               flush_engine_log();  // SPDK's own account of why it failed
               throw;
             }
             flush_engine_log();
             log_note("device '" + d->name() + "'", d->note());
             return d;
           }),
           py::arg("path"), py::arg("capacity") = 0, py::arg("backend") = "uring",
           py::arg("queue_depth") = 32, py::arg("sqpoll") = false, py::arg("create") = true,
           py::arg("name") = "", py::arg("threads") = 0, py::arg("spdk_core_mask") = "")
      .def_property_readonly("path", &Device::path)
      .def_property_readonly("name", &Device::name)
      .def_property_readonly("backend", &Device::backend_name)
      .def_property_readonly("kind", &Device::kind)
      .def_property_readonly("capacity", &Device::capacity)
      .def_property_readonly("alignment", &Device::alignment)
      .def_property_readonly("mem_alignment", &Device::mem_alignment)
      .def_property_readonly("queue_depth", &Device::queue_depth)
      .def_property_readonly("max_transfer", &Device::max_transfer)
      .def_property_readonly("state",
                             [](Device& d) {
                               flush_engine_log();
                               return d.state();
                             })
      .def_property_readonly("sqpoll", &Device::sqpoll)
      .def_property_readonly("closed", &Device::closed)
      .def_property_readonly("note", &Device::note)
      .def(
          "alloc", [](Device& d, uint64_t n) { return d.allocator().alloc(n); },
          py::arg("nbytes"))
      .def(
          "free", [](Device& d, uint64_t off) { d.allocator().free(off); }, py::arg("offset"))
      .def_property_readonly("used_bytes", [](Device& d) { return d.allocator().used_bytes(); })
      .def_property_readonly("free_bytes", [](Device& d) { return d.allocator().free_bytes(); })
      .def_property_readonly("largest_free",
                             [](Device& d) { return d.allocator().largest_free(); })
      .def(
          "register_host_pools",
          [](Device& d, std::vector<std::shared_ptr<HostPool>> pools) {
            py::gil_scoped_release nogil;
            d.register_host_pools(pools);
          },
          py::arg("pools"))
      .def(
          "submit_write", [](Device& d, py::handle ops) { return submit(d, ops, true); },
          py::arg("ops"))
      .def(
          "submit_read", [](Device& d, py::handle ops) { return submit(d, ops, false); },
          py::arg("ops"))
      .def("poll", &Device::poll, py::arg("ticket"))
      .def(
          "wait",
          [](Device& d, uint64_t ticket, py::object timeout, bool check) {
            return wait_ticket(d, ticket, timeout, check);
          },
          py::arg("ticket"), py::arg("timeout") = py::none(), py::arg("check") = true)
      .def(
          "write",
          [](Device& d, py::handle ops, bool check) {
            return wait_ticket(d, submit(d, ops, true), py::none(), check);
          },
          py::arg("ops"), py::arg("check") = true)
      .def(
          "read",
          [](Device& d, py::handle ops, bool check) {
            return wait_ticket(d, submit(d, ops, false), py::none(), check);
          },
          py::arg("ops"), py::arg("check") = true)
      .def("stats",
           [](Device& d) {
             const DeviceStats s = d.stats();
             py::dict out;
             out["bytes_read"] = s.bytes_read;
             out["bytes_written"] = s.bytes_written;
             out["reads"] = s.reads;
             out["writes"] = s.writes;
             out["errors"] = s.errors;
             out["corrupt"] = s.corrupt;
             out["inflight"] = s.inflight;
             out["reconnects"] = s.reconnects;
             flush_engine_log();
             return out;
           })
      .def("close", &Device::close, py::call_guard<py::gil_scoped_release>())
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__",
           [](Device& d, py::args) {
             py::gil_scoped_release nogil;
             d.close();
             return false;
           })
      .def("__repr__", [](Device& d) {
        return "Device(name='" + d.name() + "', backend='" + d.backend_name() + "', kind='" +
               d.kind() + "', capacity=" + std::to_string(d.capacity()) +
               ", alignment=" + std::to_string(d.alignment()) +
               (d.closed() ? ", closed" : "") + ")";
      });

  m.def(
      "probe_device",
      [](Device& dev, double seconds, uint64_t chunk_bytes, unsigned queue_depth, bool write,
         std::shared_ptr<HostPool> pool) {
        DeviceProbe p;
        {
          py::gil_scoped_release nogil;
          p = probe_device(dev, seconds, chunk_bytes, queue_depth, write, pool.get());
        }
        return probe_to_dict(p);
      },
      py::arg("device"), py::arg("seconds") = 2.0, py::arg("chunk_bytes") = 2 * kMiB,
      py::arg("queue_depth") = 0, py::arg("write") = true, py::arg("pool") = nullptr,
      "Write-then-read bandwidth probe of a device on a scratch extent; GB/s.");
  m.def(
      "probe_memcpy",
      [](std::shared_ptr<HostPool> pool, double seconds, uint64_t nbytes, unsigned threads) {
        MemcpyProbe p;
        {
          py::gil_scoped_release nogil;
          p = probe_memcpy(pool.get(), seconds, nbytes, threads);
        }
        py::dict d;
        d["gbps"] = p.gbps;
        d["bytes"] = p.bytes;
        d["seconds"] = p.seconds;
        d["threads"] = p.threads;
        return d;
      },
      py::arg("pool") = nullptr, py::arg("seconds") = 0.5, py::arg("nbytes") = 64 * kMiB,
      py::arg("threads") = 1, "memcpy bandwidth inside a host pool (or private memory); GB/s.");
}
