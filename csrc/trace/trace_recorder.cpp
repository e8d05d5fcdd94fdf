#include "trace/trace_recorder.h"

#include <c10/util/Exception.h>

#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <deque>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "trace/stream_tracer.h"

namespace torch_stage::trace {

namespace detail {
std::atomic<bool> g_enabled{false};
} // namespace detail

namespace {
// The recording's number, read without the registry lock by recording
// threads to tell whether their buffer belongs to it.
std::atomic<uint64_t> g_session{0};
} // namespace

namespace {

struct ThreadBuffer {
  std::mutex mu; // the owning thread appends; stop() collects
  uint64_t session = 0;
  ThreadRecords data; // guarded by mu
};

struct Registry {
  std::mutex mu;
  uint64_t session = 0; // guarded by mu; 0: never started
  bool on = false; // guarded by mu
  int64_t start_ns = 0; // guarded by mu
  std::vector<std::shared_ptr<ThreadBuffer>> buffers; // guarded by mu
};

// Never destroyed: producers may record while static destructors run.
Registry& registry() {
  static auto* r = new Registry();
  return *r;
}

struct Names {
  std::mutex mu;
  std::deque<std::string> by_id; // deque: stable addresses; guarded by mu
  std::unordered_map<std::string, int32_t> ids; // guarded by mu
};

Names& names_table() {
  static auto* n = new Names();
  return *n;
}

thread_local std::shared_ptr<ThreadBuffer> tls_buffer;
thread_local std::string tls_name;

std::string current_thread_name() {
  char buf[32] = {0};
  if (pthread_getname_np(pthread_self(), buf, sizeof(buf)) != 0) {
    return "";
  }
  return buf;
}

ThreadBuffer& this_thread_buffer() {
  if (tls_buffer &&
      tls_buffer->session == g_session.load(std::memory_order_acquire)) {
    return *tls_buffer;
  }
  Registry& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  if (!tls_buffer || tls_buffer->session != reg.session) {
    auto buffer = std::make_shared<ThreadBuffer>();
    buffer->session = reg.session;
    buffer->data.tid = static_cast<int64_t>(::syscall(SYS_gettid));
    buffer->data.thread_name =
        tls_name.empty() ? current_thread_name() : tls_name;
    buffer->data.records.reserve(1024);
    reg.buffers.push_back(buffer);
    tls_buffer = std::move(buffer);
  }
  return *tls_buffer;
}

} // namespace

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void start() {
  Registry& reg = registry();
  {
    std::lock_guard<std::mutex> lock(reg.mu);
    TORCH_CHECK(
        !reg.on,
        "a torch_stage trace is already recording; end it before starting "
        "another");
    reg.on = true;
    ++reg.session;
    g_session.store(reg.session, std::memory_order_release);
    reg.buffers.clear();
    reg.start_ns = now_ns();
  }
  install_stream_tracer();
  detail::g_enabled.store(true, std::memory_order_release);
}

Collected stop() {
  Registry& reg = registry();
  std::vector<std::shared_ptr<ThreadBuffer>> buffers;
  Collected out;
  {
    std::lock_guard<std::mutex> lock(reg.mu);
    if (!reg.on) {
      return out;
    }
    reg.on = false;
    detail::g_enabled.store(false, std::memory_order_release);
    // A new session number: a thread recording after this point starts a
    // buffer nobody collects instead of appending to a collected one.
    ++reg.session;
    g_session.store(reg.session, std::memory_order_release);
    buffers.swap(reg.buffers);
    out.start_ns = reg.start_ns;
  }
  remove_stream_tracer();
  out.stop_ns = now_ns();
  for (auto& buffer : buffers) {
    std::lock_guard<std::mutex> lock(buffer->mu);
    ThreadRecords records;
    records.tid = buffer->data.tid;
    records.thread_name = buffer->data.thread_name;
    records.records.swap(buffer->data.records);
    out.threads.push_back(std::move(records));
  }
  return out;
}

int32_t intern(const std::string& name) {
  Names& n = names_table();
  std::lock_guard<std::mutex> lock(n.mu);
  auto it = n.ids.find(name);
  if (it != n.ids.end()) {
    return it->second;
  }
  const auto id = static_cast<int32_t>(n.by_id.size());
  n.by_id.push_back(name);
  n.ids.emplace(name, id);
  return id;
}

const char* name(int32_t id) {
  Names& n = names_table();
  std::lock_guard<std::mutex> lock(n.mu);
  TORCH_INTERNAL_ASSERT(id >= 0 && static_cast<size_t>(id) < n.by_id.size());
  return n.by_id[static_cast<size_t>(id)].c_str();
}

std::vector<std::string> names() {
  Names& n = names_table();
  std::lock_guard<std::mutex> lock(n.mu);
  return {n.by_id.begin(), n.by_id.end()};
}

void set_thread_name(std::string name) {
  tls_name = std::move(name);
}

void record(const Record& r) {
  ThreadBuffer& buffer = this_thread_buffer();
  std::lock_guard<std::mutex> lock(buffer.mu);
  buffer.data.records.push_back(r);
}

} // namespace torch_stage::trace
