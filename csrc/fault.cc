#include "fault.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "common.h"

namespace kvio {
namespace {

std::mutex g_mu;
std::vector<FaultRule> g_rules;
std::string g_env_spec;  // the KVPOOL_FAULTS value last installed
bool g_env_taken = false;

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\n");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\n") - b + 1);
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    const size_t end = s.find(sep, start);
    out.push_back(trim(s.substr(start, end == std::string::npos ? end : end - start)));
    if (end == std::string::npos) return out;
    start = end + 1;
  }
}

[[noreturn]] void bad(size_t rule, const std::string& text, const std::string& problem) {
  throw Error(ErrorKind::Value, "faults", -1, EINVAL,
              "KVPOOL_FAULTS: rule " + std::to_string(rule) + " '" + text + "': " + problem +
                  " (expected device=<name>,op=<read|write>,errno=<EIO|ENOSPC>,after=<N>,"
                  "count=<M>)");
}

uint64_t parse_count(size_t rule, const std::string& text, const std::string& key,
                     const std::string& value) {
  if (value.empty() || value.find_first_not_of("0123456789") != std::string::npos) {
    bad(rule, text, key + " must be a non-negative integer, got '" + value + "'");
  }
  errno = 0;
  const unsigned long long v = std::strtoull(value.c_str(), nullptr, 10);
  if (errno == ERANGE) bad(rule, text, key + " is out of range");
  return v;
}

FaultRule parse_rule(size_t n, const std::string& text) {
  FaultRule r;
  bool have_device = false, have_op = false, have_errno = false;
  for (const std::string& field : split(text, ',')) {
    const size_t eq = field.find('=');
    if (eq == std::string::npos) bad(n, text, "field '" + field + "' is not key=value");
    const std::string key = trim(field.substr(0, eq)), value = trim(field.substr(eq + 1));
    if (key == "device") {
      if (value.empty()) bad(n, text, "device is empty");
      r.device = value;
      have_device = true;
    } else if (key == "op") {
      if (value != "read" && value != "write") {
        bad(n, text, "op must be read or write, got '" + value + "'");
      }
      r.write = value == "write";
      have_op = true;
    } else if (key == "errno") {
      if (value == "EIO") {
        r.err = EIO;
      } else if (value == "ENOSPC") {
        r.err = ENOSPC;
      } else {
        bad(n, text, "errno must be EIO or ENOSPC, got '" + value + "'");
      }
      have_errno = true;
    } else if (key == "after") {
      r.after = parse_count(n, text, key, value);
    } else if (key == "count") {
      r.count = parse_count(n, text, key, value);
    } else {
      bad(n, text, "unknown field '" + key + "'");
    }
  }
  if (!have_device || !have_op || !have_errno) bad(n, text, "device, op and errno are required");
  if (r.err == ENOSPC && !r.write) bad(n, text, "ENOSPC is a write error (op=write)");
  return r;
}

// Wraps a real backend; the wrapped backend completes into this object, which replaces the
// outcome of the requests a rule chose.
class FaultBackend final : public Backend {
 public:
  FaultBackend(std::string device, CompletionFn complete)
      : device_(std::move(device)), complete_(std::move(complete)) {}
  ~FaultBackend() override {
    if (inner_) inner_->shutdown();  // its threads complete into this object
  }

  void set_inner(std::unique_ptr<Backend> inner) { inner_ = std::move(inner); }

  const char* name() const override { return inner_->name(); }

  void submit(const std::vector<Request*>& reqs) override {
    std::vector<Request*> pass;
    std::vector<std::pair<Request*, std::string>> refused;  // ENOSPC: nothing written
    pass.reserve(reqs.size());
    const Ticket* ticket = nullptr;
    uint32_t index = 0;
    Fault fault;
    {
      std::lock_guard<std::mutex> l(mu_);
      for (Request* r : reqs) {
        if (r == reqs.front() || r->ticket != ticket || r->index != index) {
          // A new op: the requests of one op are adjacent and share its fate.
          ticket = r->ticket;
          index = r->index;
          fault = Fault{};
          fault.err = fault_for(device_, r->write, &fault.detail);
        }
        if (fault.err == ENOSPC) {
          refused.emplace_back(r, fault.detail);
          continue;
        }
        if (fault.err) faulted_[r] = fault;
        pass.push_back(r);
      }
    }
    if (!pass.empty()) inner_->submit(pass);
    for (const auto& [r, detail] : refused) complete_(r, ENOSPC, detail);
  }

  void register_regions(const std::vector<Region>& regions) override {
    inner_->register_regions(regions);
  }
  void shutdown() override { inner_->shutdown(); }
  std::string note() const override { return inner_->note(); }
  bool sqpoll() const override { return inner_->sqpoll(); }
  uint64_t inflight() const override { return inner_->inflight(); }
  bool needs_hugetlb() const override { return inner_->needs_hugetlb(); }
  std::string state() const override { return inner_->state(); }
  uint64_t reconnects() const override { return inner_->reconnects(); }

  // The wrapped backend's completion: a chosen request's real outcome is replaced by its fault
  // (unless the I/O failed by itself).
  void inner_done(Request* r, int err, const std::string& detail) {
    Fault fault;
    {
      std::lock_guard<std::mutex> l(mu_);
      auto it = faulted_.find(r);
      if (it != faulted_.end()) {
        fault = std::move(it->second);
        faulted_.erase(it);
      }
    }
    if (!fault.err || err) {
      complete_(r, err, detail);
      return;
    }
    if (!r->write) std::memset(reinterpret_cast<void*>(r->addr), kFaultPoison, r->length);
    complete_(r, fault.err, fault.detail);
  }

 private:
  struct Fault {
    int err = 0;
    std::string detail;
  };

  std::string device_;
  CompletionFn complete_;
  std::unique_ptr<Backend> inner_;
  std::mutex mu_;
  std::unordered_map<Request*, Fault> faulted_;
};

}  // namespace

std::vector<FaultRule> parse_fault_spec(const std::string& spec) {
  std::vector<FaultRule> rules;
  size_t n = 0;
  for (const std::string& text : split(spec, ';')) {
    if (text.empty()) continue;
    rules.push_back(parse_rule(++n, text));
  }
  return rules;
}

void set_faults(const std::string& spec) {
  auto rules = parse_fault_spec(spec);
  std::lock_guard<std::mutex> l(g_mu);
  g_rules = std::move(rules);
}

void load_env_faults() {
  const char* env = std::getenv("KVPOOL_FAULTS");
  if (!env) return;
  std::lock_guard<std::mutex> l(g_mu);
  if (g_env_taken && g_env_spec == env) return;
  g_rules = parse_fault_spec(env);
  g_env_spec = env;
  g_env_taken = true;
}

std::vector<FaultRule> current_faults() {
  std::lock_guard<std::mutex> l(g_mu);
  return g_rules;
}

int fault_for(const std::string& device, bool write, std::string* detail) {
  std::lock_guard<std::mutex> l(g_mu);
  int err = 0;
  for (size_t i = 0; i < g_rules.size(); ++i) {
    FaultRule& r = g_rules[i];
    if (r.device != device || r.write != write) continue;
    ++r.seen;
    const bool in_window = r.seen > r.after && (r.count == 0 || r.seen <= r.after + r.count);
    if (in_window && !err) {
      err = r.err;
      ++r.injected;
      *detail = "injected fault (KVPOOL_FAULTS rule " + std::to_string(i + 1) + ")";
    }
  }
  return err;
}

std::unique_ptr<Backend> with_faults(const BackendOptions& opts, const BackendFactory& make) {
  auto wrapper = std::make_unique<FaultBackend>(opts.device, opts.complete);
  FaultBackend* self = wrapper.get();
  BackendOptions inner = opts;
  inner.complete = [self](Request* r, int err, const std::string& detail) {
    self->inner_done(r, err, detail);
  };
  wrapper->set_inner(make(inner));
  return wrapper;
}

}  // namespace kvio
