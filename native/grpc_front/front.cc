// tunegate-grpc-front: the sidecar's gRPC client path, compiled (libgrpc++, completion-queue async API).
//
// Serves Triton's inference.GRPCInferenceService in front of Triton's gRPC port, passing calls through as bytes.
// The sidecar (sidecar/grpc_native.py) starts it as its child and talks to it over a Unix socket:
//   sidecar -> front  'T' the routing table: each model's live version, whether a canary is taking evidence and
//                         at what sample rate, the capture rate (sent whenever it changes)
//                     'Q' how many client calls are in flight per (model, routed version), answered with 'A'
//                     'B' "model \t 1|0": a shadow-paired canary's pair is out, or back; no offers while out
//                         (a hint: the sidecar admits or refuses each offer; a new table clears the flags)
//   front -> sidecar  'O' a sampled, answered ModelInfer (request and answer bytes, client latency, flags):
//                         the sidecar mirrors it to the candidate and/or captures it, as for its own requests
//                     'S' counts since the last 'S' (per method and code, per model/version latency buckets,
//                         the canary budgets' client-latency windows, offers dropped), every 200 ms
//                     'A' the answer to 'Q'
// The front never waits for the sidecar: offers go through a bounded queue written by its own thread, and a
// full queue drops the offer (counted). It exits when the sidecar closes the socket or dies.
//
// Protobuf is read at the wire level for the few fields it needs (model name and version, input names, shapes
// and parameter keys); an unversioned ModelInfer is pinned to the live version by appending field 2, which a
// protobuf parser reads as the field's value (the last one wins).

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <absl/synchronization/mutex.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace {

using grpc::ByteBuffer;
using grpc::Status;
using grpc::StatusCode;
using Clock = std::chrono::steady_clock;

const char* kService = "inference.GRPCInferenceService";

// -- options ---------------------------------------------------------------------------------------------------
struct Options {
  std::string listen, upstream, control, shadow_suffix = "__canary";
  int max_message_bytes = 64 << 20, max_concurrent = 1000, channels = 1, threads = 1;
  double upstream_timeout_s = 30.0;
  std::vector<double> latency_buckets;  // the sidecar's request-latency histogram bounds (seconds)
  std::set<std::string> methods;        // the service's methods, from the protos the sidecar ships
  size_t max_queue_bytes = 64u << 20;   // offers waiting for the sidecar; beyond, dropped
};
Options g_opt;

std::vector<double> split_doubles(const std::string& s) {
  std::vector<double> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(std::stod(item));
  return out;
}

// -- the sidecar's state, as last sent ---------------------------------------------------------------------------
struct Route {
  std::string live;     // "" : no live version known (unversioned calls go to Triton as they are)
  bool canary = false;  // a canary takes evidence: count client latencies, sample at `rate`
  double rate = 0.0;
  uint64_t window = 0;  // the canary budget's latency window these calls' latencies belong to
};

std::mutex g_mu;  // guards g_routes, g_capture_rate, g_in_flight, g_busy
std::unordered_map<std::string, Route> g_routes;
std::set<std::string> g_busy;  // models whose canary's pair is out: their calls are not offered
double g_capture_rate = 0.0;
std::map<std::pair<std::string, std::string>, long> g_in_flight;

// -- counts since the last report --------------------------------------------------------------------------------
struct Observed {
  uint64_t count = 0;
  double sum = 0.0;
  std::vector<uint64_t> buckets;  // len(latency_buckets) + 1, or empty for calls without a latency
};
std::mutex g_stats_mu;
std::map<std::pair<std::string, std::string>, uint64_t> g_calls;  // (method label, code name)
std::map<std::tuple<std::string, std::string, int>, Observed> g_requests;  // (model, version, http code)
std::map<std::pair<std::string, uint64_t>, std::map<int, uint64_t>> g_budget;  // (model, window) -> bin -> n
std::map<std::string, uint64_t> g_dropped;                // model -> offers the queue had no room for

// The canary budget's bins (sidecar/budget.py BOUNDS): 5e-5 * 1.01**k, k < 1400.
std::vector<double> g_budget_bounds;

const char* code_name(StatusCode c) {
  switch (c) {
    case StatusCode::OK: return "OK";
    case StatusCode::CANCELLED: return "CANCELLED";
    case StatusCode::UNKNOWN: return "UNKNOWN";
    case StatusCode::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case StatusCode::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case StatusCode::NOT_FOUND: return "NOT_FOUND";
    case StatusCode::ALREADY_EXISTS: return "ALREADY_EXISTS";
    case StatusCode::PERMISSION_DENIED: return "PERMISSION_DENIED";
    case StatusCode::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case StatusCode::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case StatusCode::ABORTED: return "ABORTED";
    case StatusCode::OUT_OF_RANGE: return "OUT_OF_RANGE";
    case StatusCode::UNIMPLEMENTED: return "UNIMPLEMENTED";
    case StatusCode::INTERNAL: return "INTERNAL";
    case StatusCode::UNAVAILABLE: return "UNAVAILABLE";
    case StatusCode::DATA_LOSS: return "DATA_LOSS";
    case StatusCode::UNAUTHENTICATED: return "UNAUTHENTICATED";
    default: return "UNKNOWN";
  }
}

// gRPC status -> the HTTP status Triton answers for the same failure (sidecar/grpc_front.py HTTP_OF).
int http_of(StatusCode c) {
  switch (c) {
    case StatusCode::OK: return 200;
    case StatusCode::INVALID_ARGUMENT: return 400;
    case StatusCode::NOT_FOUND: return 404;
    case StatusCode::PERMISSION_DENIED: return 403;
    case StatusCode::RESOURCE_EXHAUSTED: return 429;
    case StatusCode::UNAVAILABLE: return 502;
    case StatusCode::DEADLINE_EXCEEDED: return 504;
    case StatusCode::CANCELLED: return 499;
    default: return 500;
  }
}

std::string method_label(const std::string& m) { return g_opt.methods.count(m) ? m : "other"; }

void count_call(const std::string& method, StatusCode code) {
  std::lock_guard<std::mutex> lock(g_stats_mu);
  ++g_calls[{method_label(method), code_name(code)}];
}

// -- the control socket ------------------------------------------------------------------------------------------
int g_sock = -1;
std::mutex g_queue_mu;
std::condition_variable g_queue_cv;
std::deque<std::string> g_queue;  // frames to the sidecar
size_t g_queue_bytes = 0;
std::atomic<bool> g_stop{false};

std::string frame(char type, const std::string& payload) {
  std::string f(5, '\0');
  uint32_t n = static_cast<uint32_t>(payload.size() + 1);
  std::memcpy(&f[0], &n, 4);  // little-endian hosts only (x86-64, aarch64)
  f[4] = type;
  f += payload;
  return f;
}

// Queue a frame; `droppable` frames (offers) are dropped when the queue is full, the others always go.
bool enqueue(std::string f, bool droppable) {
  {
    std::lock_guard<std::mutex> lock(g_queue_mu);
    if (droppable && g_queue_bytes + f.size() > g_opt.max_queue_bytes) return false;
    g_queue_bytes += f.size();
    g_queue.push_back(std::move(f));
  }
  g_queue_cv.notify_one();
  return true;
}

bool write_all(int fd, const char* p, size_t n) {
  while (n > 0) {
    ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool read_all(int fd, char* p, size_t n) {
  while (n > 0) {
    ssize_t r = ::recv(fd, p, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

// Names a client chose (model, version) travel in tab- and newline-separated lines: one with a control
// character is left out of the reports (no model Triton serves has one; Triton answers such calls itself).
bool plain(const std::string& s) {
  for (unsigned char c : s)
    if (c < 0x20 || c == 0x7f) return false;
  return true;
}

std::string stats_payload() {
  std::ostringstream out;
  out.precision(17);
  std::lock_guard<std::mutex> lock(g_stats_mu);
  for (auto& [k, n] : g_calls) out << "c\t" << k.first << '\t' << k.second << '\t' << n << '\n';
  for (auto& [k, o] : g_requests) {
    if (!plain(std::get<0>(k)) || !plain(std::get<1>(k))) continue;
    out << "r\t" << std::get<0>(k) << '\t' << std::get<1>(k) << '\t' << std::get<2>(k) << '\t' << o.count << '\t'
        << o.sum << '\t';
    for (size_t i = 0; i < o.buckets.size(); ++i) out << (i ? "," : "") << o.buckets[i];
    out << '\n';
  }
  for (auto& [key, bins] : g_budget) {
    if (!plain(key.first)) continue;
    out << "b\t" << key.first << '\t' << key.second << '\t';
    bool first = true;
    for (auto& [i, n] : bins) {
      out << (first ? "" : ",") << i << ':' << n;
      first = false;
    }
    out << '\n';
  }
  for (auto& [model, n] : g_dropped)
    if (plain(model)) out << "d\t" << model << '\t' << n << '\n';
  g_calls.clear();
  g_requests.clear();
  g_budget.clear();
  g_dropped.clear();
  return out.str();
}

void writer_loop() {
  auto next_stats = Clock::now();
  while (!g_stop) {
    std::deque<std::string> batch;
    {
      std::unique_lock<std::mutex> lock(g_queue_mu);
      g_queue_cv.wait_until(lock, next_stats, [] { return !g_queue.empty() || g_stop.load(); });
      batch.swap(g_queue);
      g_queue_bytes = 0;
    }
    if (Clock::now() >= next_stats) {
      std::string s = stats_payload();
      if (!s.empty()) batch.push_back(frame('S', s));
      next_stats = Clock::now() + std::chrono::milliseconds(200);
    }
    for (auto& f : batch) {
      if (!write_all(g_sock, f.data(), f.size())) {
        g_stop = true;
        break;
      }
    }
  }
}

void apply_table(const std::string& payload) {
  // line 1: capture rate; then "model \t live \t canary(0|1) \t rate \t budget window"
  std::unordered_map<std::string, Route> routes;
  std::stringstream ss(payload);
  std::string line;
  double capture = 0.0;
  if (std::getline(ss, line)) capture = std::stod(line);
  while (std::getline(ss, line)) {
    std::stringstream ls(line);
    std::string model, live, canary, rate, window;
    if (!std::getline(ls, model, '\t') || !std::getline(ls, live, '\t') || !std::getline(ls, canary, '\t') ||
        !std::getline(ls, rate, '\t') || !std::getline(ls, window, '\t'))
      continue;
    routes[model] = Route{live, canary == "1", std::stod(rate), std::stoull(window)};
  }
  std::lock_guard<std::mutex> lock(g_mu);
  g_routes.swap(routes);
  g_capture_rate = capture;
  g_busy.clear();  // a canary started or ended: its pair flags start again (the next 'B' sets them)
}

void apply_busy(const std::string& payload) {
  size_t tab = payload.rfind('\t');
  if (tab == std::string::npos) return;
  std::string model = payload.substr(0, tab);
  std::lock_guard<std::mutex> lock(g_mu);
  if (payload.substr(tab + 1) == "1")
    g_busy.insert(model);
  else
    g_busy.erase(model);
}

bool pair_busy(const std::string& model) {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_busy.count(model) > 0;
}

std::string in_flight_payload(const std::string& seq) {
  std::ostringstream out;
  out << seq << '\n';
  std::lock_guard<std::mutex> lock(g_mu);
  for (auto& [k, n] : g_in_flight)
    if (n && plain(k.first) && plain(k.second)) out << k.first << '\t' << k.second << '\t' << n << '\n';
  return out.str();
}

void reader_loop(grpc::Server* server) {
  for (;;) {
    uint32_t n;
    if (!read_all(g_sock, reinterpret_cast<char*>(&n), 4) || n == 0 || n > (16u << 20)) break;
    std::string body(n, '\0');
    if (!read_all(g_sock, &body[0], n)) break;
    char type = body[0];
    std::string payload = body.substr(1);
    if (type == 'T') {
      apply_table(payload);
    } else if (type == 'B') {
      apply_busy(payload);
    } else if (type == 'Q') {
      enqueue(frame('A', in_flight_payload(payload)), false);
    }
  }
  // The sidecar is gone (or closed the socket to stop us): stop serving.
  g_stop = true;
  g_queue_cv.notify_all();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
}

// -- protobuf at the wire level ----------------------------------------------------------------------------------
struct Wire {
  const uint8_t* p;
  const uint8_t* end;
  bool varint(uint64_t& v) {
    v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (p >= end) return false;
      uint8_t b = *p++;
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if (!(b & 0x80)) return true;
    }
    return false;
  }
  // Reads a tag; false at the end (ok stays true) or on a malformed tag (ok false).
  bool tag(uint32_t& field, uint32_t& type, bool& ok) {
    ok = true;
    if (p >= end) return false;
    uint64_t t;
    if (!varint(t) || t > 0xffffffffu || (t >> 3) == 0) {
      ok = false;
      return false;
    }
    field = static_cast<uint32_t>(t >> 3);
    type = static_cast<uint32_t>(t & 7);
    return true;
  }
  bool bytes(const uint8_t*& data, size_t& len) {
    uint64_t n;
    if (!varint(n) || n > static_cast<uint64_t>(end - p)) return false;
    data = p;
    len = static_cast<size_t>(n);
    p += n;
    return true;
  }
  bool skip(uint32_t type) {
    uint64_t v;
    const uint8_t* d;
    size_t n;
    switch (type) {
      case 0: return varint(v);
      case 1: if (end - p < 8) return false; p += 8; return true;
      case 2: return bytes(d, n);
      case 5: if (end - p < 4) return false; p += 4; return true;
      default: return false;  // groups (3, 4) are not used by these protos; 6 and 7 do not exist
    }
  }
};

bool valid_utf8(const uint8_t* s, size_t n) {
  size_t i = 0;
  while (i < n) {
    uint8_t c = s[i];
    size_t k = c < 0x80 ? 0 : (c >> 5) == 6 ? 1 : (c >> 4) == 14 ? 2 : (c >> 3) == 30 ? 3 : 4;
    if (k == 4 || n - i <= k) return false;
    for (size_t j = 1; j <= k; ++j)
      if ((s[i + j] & 0xc0) != 0x80) return false;
    if (k == 1 && c < 0xc2) return false;  // overlong
    if (k == 2) {
      uint32_t cp = ((c & 0x0f) << 12) | ((s[i + 1] & 0x3f) << 6) | (s[i + 2] & 0x3f);
      if (cp < 0x800 || (cp >= 0xd800 && cp <= 0xdfff)) return false;
    }
    if (k == 3) {
      uint32_t cp = ((c & 0x07) << 18) | ((s[i + 1] & 0x3f) << 12) | ((s[i + 2] & 0x3f) << 6) | (s[i + 3] & 0x3f);
      if (cp < 0x10000 || cp > 0x10ffff) return false;
    }
    i += k + 1;
  }
  return true;
}

struct InferRequest {
  std::string model, version;
  std::string refusal;  // INVALID_ARGUMENT when set
  bool malformed = false;
};

const char* kSharedMemoryKeys[] = {"shared_memory_region", "shared_memory_byte_size", "shared_memory_offset"};

std::string u128_str(unsigned __int128 v) {
  if (v == 0) return "0";
  std::string s;
  while (v) {
    s.insert(s.begin(), static_cast<char>('0' + static_cast<int>(v % 10)));
    v /= 10;
  }
  return s;
}

// The shape check of sidecar/grpc_front.py shape_refusal: an input whose shape holds more elements than the
// message's bytes could carry, or a negative dimension. Inputs in shared memory are not checked.
std::string check_input(const uint8_t* d, size_t n, size_t size) {
  Wire w{d, d + n};
  std::string name;
  std::vector<int64_t> shape;
  bool shared = false, ok;
  uint32_t field, type;
  while (w.tag(field, type, ok)) {
    const uint8_t* b;
    size_t len;
    if (field == 1 && type == 2) {
      if (!w.bytes(b, len)) return "\x01";
      name.assign(reinterpret_cast<const char*>(b), len);
    } else if (field == 3 && type == 2) {  // packed
      if (!w.bytes(b, len)) return "\x01";
      Wire pw{b, b + len};
      while (pw.p < pw.end) {
        uint64_t v;
        if (!pw.varint(v)) return "\x01";
        shape.push_back(static_cast<int64_t>(v));
      }
    } else if (field == 3 && type == 0) {
      uint64_t v;
      if (!w.varint(v)) return "\x01";
      shape.push_back(static_cast<int64_t>(v));
    } else if (field == 4 && type == 2) {  // map entry: key is field 1
      if (!w.bytes(b, len)) return "\x01";
      Wire ew{b, b + len};
      uint32_t ef, et;
      bool eok;
      while (ew.tag(ef, et, eok)) {
        const uint8_t* kb;
        size_t kl;
        if (ef == 1 && et == 2) {
          if (!ew.bytes(kb, kl)) return "\x01";
          std::string key(reinterpret_cast<const char*>(kb), kl);
          for (const char* k : kSharedMemoryKeys)
            if (key == k) shared = true;
        } else if (!ew.skip(et)) {
          return "\x01";
        }
      }
      if (!eok) return "\x01";
    } else if (!w.skip(type)) {
      return "\x01";
    }
  }
  if (!ok) return "\x01";
  if (shared) return "";
  std::ostringstream dims;
  dims << '[';
  for (size_t i = 0; i < shape.size(); ++i) dims << (i ? ", " : "") << shape[i];
  dims << ']';
  for (int64_t s : shape)
    if (s < 0) return "input '" + name + "': shape " + dims.str() + " has a negative dimension";
  unsigned __int128 total = 1;
  bool big = false;
  const unsigned __int128 cap = static_cast<unsigned __int128>(1) << 126;
  for (int64_t s : shape) {
    if (s == 0) {
      total = 0;
      big = false;
      break;
    }
    if (!big) {  // checked before multiplying: a product past 2^128 would wrap to a small count
      if (total > cap / static_cast<unsigned __int128>(s))
        big = true;
      else
        total *= static_cast<unsigned __int128>(s);
    }
  }
  if (big || total > size)
    return "input '" + name + "' of shape " + dims.str() + " has " + (big ? "more than 2^126" : u128_str(total)) +
           " elements, more than the " + std::to_string(size) + " bytes of the request can hold";
  return "";
}

InferRequest parse_infer(const std::string& raw) {
  InferRequest r;
  const uint8_t* d = reinterpret_cast<const uint8_t*>(raw.data());
  Wire w{d, d + raw.size()};
  uint32_t field, type;
  bool ok;
  while (w.tag(field, type, ok)) {
    const uint8_t* b;
    size_t len;
    if ((field == 1 || field == 2) && type == 2) {
      if (!w.bytes(b, len) || !valid_utf8(b, len)) {
        r.malformed = true;
        return r;
      }
      (field == 1 ? r.model : r.version).assign(reinterpret_cast<const char*>(b), len);
    } else if (field == 5 && type == 2) {
      if (!w.bytes(b, len)) {
        r.malformed = true;
        return r;
      }
      if (r.refusal.empty()) {
        std::string why = check_input(b, len, raw.size());
        if (why == "\x01") {
          r.malformed = true;
          return r;
        }
        r.refusal = why;
      }
    } else if (!w.skip(type)) {
      r.malformed = true;
      return r;
    }
  }
  if (!ok) r.malformed = true;
  return r;
}

// The `name` (field 1) of ModelReady/Metadata/Config/Statistics requests; false when malformed.
bool parse_name(const std::string& raw, std::string& name) {
  const uint8_t* d = reinterpret_cast<const uint8_t*>(raw.data());
  Wire w{d, d + raw.size()};
  uint32_t field, type;
  bool ok;
  while (w.tag(field, type, ok)) {
    const uint8_t* b;
    size_t len;
    if (field == 1 && type == 2) {
      if (!w.bytes(b, len) || !valid_utf8(b, len)) return false;
      name.assign(reinterpret_cast<const char*>(b), len);
    } else if (!w.skip(type)) {
      return false;
    }
  }
  return ok;
}

std::string version_field(const std::string& version) {
  std::string f(1, '\x12');
  uint64_t n = version.size();
  while (n >= 0x80) {
    f.push_back(static_cast<char>((n & 0x7f) | 0x80));
    n >>= 7;
  }
  f.push_back(static_cast<char>(n));
  return f + version;
}

std::string flatten(const ByteBuffer& buf) {
  std::vector<grpc::Slice> slices;
  std::string out;
  if (!buf.Dump(&slices).ok()) return out;
  size_t total = 0;
  for (auto& s : slices) total += s.size();
  out.reserve(total);
  for (auto& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

thread_local std::mt19937_64 t_rng{std::random_device{}()};
bool sample(double rate) {
  if (rate >= 1.0) return true;
  if (rate <= 0.0) return false;
  return std::uniform_real_distribution<double>(0.0, 1.0)(t_rng) < rate;
}

// -- upstream ----------------------------------------------------------------------------------------------------
std::vector<std::unique_ptr<grpc::GenericStub>> g_stubs;
std::atomic<uint64_t> g_next_stub{0};
grpc::GenericStub& stub() { return *g_stubs[g_next_stub++ % g_stubs.size()]; }
std::atomic<int> g_active{0};

const std::string kShadowRefusal = "a canary's shadow model is the sidecar's own: it serves no client";
const std::string kControlRefusal =
    "model control goes through the sidecar's admin API (/canary), not through the proxy";
const std::string kOtherRefusal =
    " is not part of what the sidecar forwards (inference, metadata, config, readiness, statistics, health, "
    "repository index)";

bool is_passed(const std::string& m) {
  return m == "ServerLive" || m == "ServerReady" || m == "ServerMetadata" || m == "RepositoryIndex";
}
bool is_named(const std::string& m) {
  return m == "ModelReady" || m == "ModelMetadata" || m == "ModelConfig" || m == "ModelStatistics";
}

void prepare(grpc::ClientContext& up, const grpc::ServerContextBase& ctx, bool limit) {
  for (auto& [k, v] : ctx.client_metadata()) {
    std::string key(k.data(), k.size());
    if (key.rfind("grpc-", 0) == 0 || key.rfind(":", 0) == 0 || key == "user-agent" || key == "te" ||
        key == "content-type" || key == "host")
      continue;
    up.AddMetadata(key, std::string(v.data(), v.size()));
  }
  auto deadline = ctx.deadline();
  if (limit) {
    auto cap = std::chrono::system_clock::now() +
               std::chrono::microseconds(static_cast<int64_t>(g_opt.upstream_timeout_s * 1e6));
    if (cap < deadline) deadline = cap;
  }
  if (deadline != std::chrono::system_clock::time_point::max()) up.set_deadline(deadline);
}

// Pins an unversioned request to the live version; returns the version routed to ("" when unknown). Counts
// the call in flight for that version under the table's lock, so a promotion that changed the table and then
// sees no call in flight on the old version knows none is on its way there.
std::string route_and_hold(const std::string& model, const std::string& version, bool& pinned, Route& route,
                           double& capture_rate) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_routes.find(model);
  if (it != g_routes.end()) route = it->second;
  capture_rate = g_capture_rate;
  std::string routed = version;
  pinned = false;
  if (version.empty() && !route.live.empty()) {
    routed = route.live;
    pinned = true;
  }
  ++g_in_flight[{model, routed}];
  return routed;
}

void release(const std::string& model, const std::string& routed) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_in_flight.find({model, routed});
  if (it != g_in_flight.end() && --it->second <= 0) g_in_flight.erase(it);
}

void observe(const std::string& model, const std::string& version, StatusCode code, double seconds, bool ok,
             bool budget, uint64_t window) {
  std::lock_guard<std::mutex> lock(g_stats_mu);
  ++g_calls[{"ModelInfer", code_name(code)}];
  Observed& o = g_requests[{model, version, http_of(code)}];
  ++o.count;
  if (ok) {
    if (o.buckets.empty()) o.buckets.assign(g_opt.latency_buckets.size() + 1, 0);
    o.sum += seconds;
    // the first bucket whose bound is >= value (bisect_left)
    size_t i = std::lower_bound(g_opt.latency_buckets.begin(), g_opt.latency_buckets.end(), seconds) -
               g_opt.latency_buckets.begin();
    ++o.buckets[i];
  }
  if (budget) {
    int i = static_cast<int>(std::lower_bound(g_budget_bounds.begin(), g_budget_bounds.end(), seconds) -
                             g_budget_bounds.begin());
    ++g_budget[{model, window}][i];
  }
}

// One answered ModelInfer to the sidecar: flags (1 mirror, 2 capture, 4 unversioned), latency, both messages.
void offer(const std::string& model, uint8_t flags, double seconds, const std::string& req, const ByteBuffer& resp) {
  std::string answer = flatten(resp);
  std::string payload(1 + 8 + 4, '\0');
  payload[0] = static_cast<char>(flags);
  std::memcpy(&payload[1], &seconds, 8);
  uint32_t n = static_cast<uint32_t>(req.size());
  std::memcpy(&payload[9], &n, 4);
  payload += req;
  payload += answer;
  if (!enqueue(frame('O', payload), true) && (flags & 1)) {  // a capture-only offer is no mirror dropped
    std::lock_guard<std::mutex> lock(g_stats_mu);
    ++g_dropped[model];
  }
}

// -- the calls ---------------------------------------------------------------------------------------------------
// The completion-queue API, as a proxy's event loop: each serving thread owns one completion queue, and every
// operation of a call, on the client's side and on Triton's, completes on the queue the call arrived on. One
// thread carries a call from its first byte to its last, with no hand-off between threads.
//
// A call counts its operations in flight; each completion runs one step, which may start more, and the call is
// deleted once none is left.
grpc::AsyncGenericService g_service;

class Call;
struct Event {
  Call* call;
  void (Call::*step)(bool);
};

class Call {
 public:
  explicit Call(grpc::ServerCompletionQueue* cq) : cq_(cq), stream_(&ctx_) {
    ctx_.AsyncNotifyWhenDone(Tag(&done_ev_, &Call::OnDone));
    g_service.RequestCall(&ctx_, &stream_, cq_, cq_, Tag(&requested_ev_, &Call::OnRequested));
  }
  static void Fire(void* tag, bool ok) {
    Event* e = static_cast<Event*>(tag);
    Call* c = e->call;
    --c->pending_;
    (c->*(e->step))(ok);
    if (c->pending_ == 0) delete c;
  }

 private:
  ~Call() {
    if (active_) --g_active;
  }
  void* Tag(Event* e, void (Call::*step)(bool)) {
    e->call = this;
    e->step = step;
    ++pending_;
    return e;
  }

  // -- the start, for every call
  void OnRequested(bool ok) {
    if (!ok) return;  // shutting down
    new Call(cq_);    // the next call on this queue
    const std::string& full = ctx_.method();
    std::string prefix = "/" + std::string(kService) + "/";
    if (full.rfind(prefix, 0) != 0) return Reply(Status(StatusCode::UNIMPLEMENTED, "Method not found!"));
    method_ = full.substr(prefix.size());
    active_ = true;  // counted from here: ~Call gives it back
    if (++g_active > g_opt.max_concurrent)
      return Refuse(Status(StatusCode::RESOURCE_EXHAUSTED,
                           "Concurrent RPC limit exceeded: more than " + std::to_string(g_opt.max_concurrent) +
                               " calls in progress (grpc_max_concurrent_rpcs)"));
    if (method_ == "ModelStreamInfer") return StreamStart();
    stream_.Read(&req_, Tag(&read_ev_, &Call::OnRead));
  }
  void OnDone(bool) {
    if (ctx_.IsCancelled()) up_.TryCancel();
  }
  void Refuse(const Status& s) {
    count_call(method_, s.error_code());
    Reply(s);
  }
  void Reply(const Status& s) { stream_.Finish(s, Tag(&finish_ev_, &Call::OnFinished)); }
  void OnFinished(bool) {}

  // -- unary calls
  void OnRead(bool ok) {
    if (!ok) return Refuse(Status(StatusCode::INVALID_ARGUMENT, "no request message"));
    if (method_ == "ModelInfer") return Infer();
    if (is_named(method_)) {
      std::string name;
      if (!parse_name(flatten(req_), name))
        return Refuse(Status(StatusCode::INVALID_ARGUMENT, "malformed " + method_ + " request"));
      if (ends_with(name, g_opt.shadow_suffix)) return Refuse(Status(StatusCode::PERMISSION_DENIED, kShadowRefusal));
    } else if (!is_passed(method_)) {
      std::string why = method_ + kOtherRefusal;
      if (method_ == "RepositoryModelLoad" || method_ == "RepositoryModelUnload") why = kControlRefusal;
      if (!g_opt.methods.count(method_)) why = std::string(kService) + " defines no such method";
      return Refuse(Status(StatusCode::PERMISSION_DENIED, why));
    }
    Upstream(req_);
  }
  void Upstream(const ByteBuffer& fwd) {
    prepare(up_, ctx_, true);
    up_unary_ = stub().PrepareUnaryCall(&up_, "/" + std::string(kService) + "/" + method_, fwd, cq_);
    up_unary_->StartCall();
    up_unary_->Finish(&resp_, &up_status_, Tag(&up_finish_ev_, &Call::OnAnswered));
  }
  void Infer() {
    raw_ = flatten(req_);
    InferRequest r = parse_infer(raw_);
    if (r.malformed)
      return Refuse(Status(StatusCode::INVALID_ARGUMENT, "malformed ModelInfer request: cannot parse it"));
    if (ends_with(r.model, g_opt.shadow_suffix)) return Refuse(Status(StatusCode::PERMISSION_DENIED, kShadowRefusal));
    if (!r.refusal.empty()) return Refuse(Status(StatusCode::INVALID_ARGUMENT, r.refusal));
    model_ = std::move(r.model);
    unversioned_ = r.version.empty();
    bool pinned;
    routed_ = route_and_hold(model_, r.version, pinned, route_, capture_rate_);
    infer_ = true;
    t0_ = Clock::now();
    if (!pinned) return Upstream(req_);
    std::vector<grpc::Slice> slices;
    req_.Dump(&slices);
    slices.push_back(grpc::Slice(version_field(routed_)));
    Upstream(ByteBuffer(slices.data(), slices.size()));
  }
  void OnAnswered(bool) {
    const Status& s = up_status_;
    if (!infer_) {
      count_call(method_, s.error_code());
      if (!s.ok()) return Reply(s);
      return stream_.WriteAndFinish(resp_, grpc::WriteOptions(), Status::OK, Tag(&finish_ev_, &Call::OnFinished));
    }
    double seconds = std::chrono::duration<double>(Clock::now() - t0_).count();
    release(model_, routed_);
    bool mirror = s.ok() && unversioned_ && route_.canary;
    observe(model_, routed_, s.error_code(), seconds, s.ok(), mirror, route_.window);
    if (!s.ok()) return Reply(s);
    stream_.WriteAndFinish(resp_, grpc::WriteOptions(), Status::OK, Tag(&finish_ev_, &Call::OnFinished));
    // After the answer is on its way (the buffers stay with this call until its last completion).
    uint8_t flags = 0;
    if (mirror && sample(route_.rate) && !pair_busy(model_)) flags |= 1;
    if (sample(capture_rate_)) flags |= 2;
    if (unversioned_) flags |= 4;
    if (flags & 3) offer(model_, flags, seconds, raw_, resp_);
  }

  // -- ModelStreamInfer: passed through as a stream, each message routed, nothing mirrored. One read and one
  // write in flight each way: client -> Triton (read, route, write) and Triton -> client (read, write).
  void StreamStart() {
    prepare(up_, ctx_, false);
    up_stream_ = stub().PrepareCall(&up_, "/" + std::string(kService) + "/ModelStreamInfer", cq_);
    up_stream_->StartCall(Tag(&up_start_ev_, &Call::OnStreamStarted));
  }
  void OnStreamStarted(bool ok) {
    if (!ok) return up_stream_->Finish(&up_status_, Tag(&up_finish_ev_, &Call::OnStreamEnded));
    stream_.Read(&req_, Tag(&read_ev_, &Call::OnStreamRequest));
    up_stream_->Read(&resp_, Tag(&up_read_ev_, &Call::OnStreamAnswer));
  }
  void OnStreamRequest(bool ok) {
    if (!ok) return up_stream_->WritesDone(Tag(&up_write_ev_, &Call::OnNothing));  // the client half-closed
    InferRequest r = parse_infer(flatten(req_));
    if (r.malformed)
      refusal_ = Status(StatusCode::INVALID_ARGUMENT, "malformed ModelInfer request in the stream: cannot parse it");
    else if (ends_with(r.model, g_opt.shadow_suffix))
      refusal_ = Status(StatusCode::PERMISSION_DENIED, kShadowRefusal);
    if (refusal_) return up_.TryCancel();
    count_call("ModelStreamInfer", StatusCode::OK);
    std::string live;
    if (r.version.empty()) {
      std::lock_guard<std::mutex> lock(g_mu);
      auto it = g_routes.find(r.model);
      if (it != g_routes.end()) live = it->second.live;
    }
    if (live.empty()) {
      out_ = req_;
    } else {
      std::vector<grpc::Slice> slices;
      req_.Dump(&slices);
      slices.push_back(grpc::Slice(version_field(live)));
      out_ = ByteBuffer(slices.data(), slices.size());
    }
    up_stream_->Write(out_, Tag(&up_write_ev_, &Call::OnStreamForwarded));
  }
  void OnStreamForwarded(bool ok) {
    if (ok) stream_.Read(&req_, Tag(&read_ev_, &Call::OnStreamRequest));
  }
  void OnNothing(bool) {}
  void OnStreamAnswer(bool ok) {
    if (!ok) return up_stream_->Finish(&up_status_, Tag(&up_finish_ev_, &Call::OnStreamEnded));
    stream_.Write(resp_, Tag(&write_ev_, &Call::OnStreamAnswered));
  }
  void OnStreamAnswered(bool ok) {
    if (ok) return up_stream_->Read(&resp_, Tag(&up_read_ev_, &Call::OnStreamAnswer));
    up_.TryCancel();  // the client is gone
    up_stream_->Finish(&up_status_, Tag(&up_finish_ev_, &Call::OnStreamEnded));
  }
  void OnStreamEnded(bool) {
    Status s = refusal_ ? *refusal_ : up_status_;
    if (!s.ok()) count_call("ModelStreamInfer", s.error_code());
    Reply(s);
  }

  grpc::ServerCompletionQueue* cq_;
  grpc::GenericServerContext ctx_;
  grpc::GenericServerAsyncReaderWriter stream_;
  grpc::ClientContext up_;
  std::unique_ptr<grpc::GenericClientAsyncResponseReader> up_unary_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> up_stream_;
  Status up_status_;
  std::optional<Status> refusal_;
  ByteBuffer req_, out_, resp_;
  std::string method_, raw_, model_, routed_;
  Route route_;
  double capture_rate_ = 0.0;
  Clock::time_point t0_;
  bool unversioned_ = false, infer_ = false, active_ = false;
  int pending_ = 0;
  Event requested_ev_, done_ev_, read_ev_, write_ev_, finish_ev_, up_start_ev_, up_read_ev_, up_write_ev_,
      up_finish_ev_;
};

void serve(grpc::ServerCompletionQueue* cq) {
  new Call(cq);
  void* tag;
  bool ok;
  while (cq->Next(&tag, &ok)) Call::Fire(tag, ok);
}

int connect_control(const std::string& path) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) return -1;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) < 0) return -1;
  return fd;
}

void usage() {
  std::fprintf(stderr,
               "usage: tunegate-grpc-front --listen HOST:PORT --upstream HOST:PORT --control UNIX_SOCKET\n"
               "       [--max-message-bytes N] [--max-concurrent N] [--upstream-timeout-s S] [--channels N] [--threads N]\n"
               "       [--latency-buckets S,S,...] [--methods M,M,...] [--shadow-suffix S] [--max-queue-bytes N]\n"
               "Started by the tunegate sidecar (grpc_front = \"native\"); not meant to run alone.\n");
}

}  // namespace

int main(int argc, char** argv) {
  prctl(PR_SET_PDEATHSIG, SIGTERM);  // the sidecar's child: never outlives it
  signal(SIGPIPE, SIG_IGN);
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      usage();
      return 0;
    }
    if (i + 1 >= argc) {
      usage();
      return 2;
    }
    std::string v = argv[++i];
    if (a == "--listen") g_opt.listen = v;
    else if (a == "--upstream") g_opt.upstream = v;
    else if (a == "--control") g_opt.control = v;
    else if (a == "--max-message-bytes") g_opt.max_message_bytes = std::stoi(v);
    else if (a == "--max-concurrent") g_opt.max_concurrent = std::stoi(v);
    else if (a == "--upstream-timeout-s") g_opt.upstream_timeout_s = std::stod(v);
    else if (a == "--channels") g_opt.channels = std::max(1, std::stoi(v));
    else if (a == "--threads") g_opt.threads = std::max(1, std::stoi(v));
    else if (a == "--latency-buckets") g_opt.latency_buckets = split_doubles(v);
    else if (a == "--shadow-suffix") g_opt.shadow_suffix = v;
    else if (a == "--max-queue-bytes") g_opt.max_queue_bytes = std::stoull(v);
    else if (a == "--methods") {
      std::stringstream ss(v);
      std::string m;
      while (std::getline(ss, m, ',')) g_opt.methods.insert(m);
    } else {
      usage();
      return 2;
    }
  }
  if (g_opt.listen.empty() || g_opt.upstream.empty() || g_opt.control.empty()) {
    usage();
    return 2;
  }
  for (int k = 0; k < 1400; ++k) g_budget_bounds.push_back(5e-5 * std::pow(1.01, k));

  g_sock = connect_control(g_opt.control);
  if (g_sock < 0) {
    std::fprintf(stderr, "tunegate-grpc-front: cannot connect to the sidecar at %s\n", g_opt.control.c_str());
    return 1;
  }
  for (int i = 0; i < g_opt.channels; ++i) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(g_opt.max_message_bytes);
    args.SetMaxSendMessageSize(g_opt.max_message_bytes);
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // one connection per channel
    args.SetInt("tunegate.channel", i);
    // A proxy adds no retries of its own: the client decides whether to retry.
    args.SetInt(GRPC_ARG_ENABLE_RETRIES, 0);
    g_stubs.push_back(std::make_unique<grpc::GenericStub>(
        grpc::CreateCustomChannel(g_opt.upstream, grpc::InsecureChannelCredentials(), args)));
  }
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(g_opt.listen, grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(g_opt.max_message_bytes);
  builder.SetMaxSendMessageSize(g_opt.max_message_bytes);
  builder.RegisterAsyncGenericService(&g_service);
  std::vector<std::unique_ptr<grpc::ServerCompletionQueue>> queues;
  for (int i = 0; i < g_opt.threads; ++i) queues.push_back(builder.AddCompletionQueue());
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    std::fprintf(stderr, "tunegate-grpc-front: cannot listen for gRPC on %s\n", g_opt.listen.c_str());
    return 1;
  }
  std::printf("listening %d\n", port);
  std::fflush(stdout);
  std::thread writer(writer_loop);
  std::thread reader(reader_loop, server.get());
  std::vector<std::thread> serving;
  for (auto& q : queues) serving.emplace_back(serve, q.get());
  server->Wait();
  for (auto& q : queues) q->Shutdown();
  for (auto& t : serving) t.join();
  g_stop = true;
  g_queue_cv.notify_all();
  ::shutdown(g_sock, SHUT_RDWR);
  reader.join();
  writer.join();
  return 0;
}
