// ringd's software CUDA device (libringd-cuda-emulated.so): the CUDA driver API subset that CudaApi
// (common/cuda/cuda_api.h) takes, with the driver's semantics and return codes, over host memory,
// for machines without a GPU. See README.md in this folder.
//
// Device memory is host memory at real addresses (a CUdeviceptr is the host address), backed by
// memfds so that legacy IPC handles and POSIX-fd VMM handles share it between processes the way
// the driver shares GPU memory. Every stream is a worker thread that runs its operations strictly
// in order. A flag or mode this device does not implement is CUDA_ERROR_NOT_SUPPORTED, never
// ignored.
//
// Where the driver's behaviour is not documented, the choice made is noted next to the code. The
// main ones:
//   - The legacy default stream does not synchronise implicitly with blocking streams (every
//     stream behaves like a CU_STREAM_NON_BLOCKING one).
//   - Memory freed or unmapped while a stream still has work on it is not a crash: work already
//     touching it finishes first, later work on it is dropped with a line on stderr and the
//     stream's context gets the sticky CUDA_ERROR_ILLEGAL_ADDRESS a GPU fault would leave.
//   - A memfd's name is "ringd-emu-cuda:<64-bit token hex>:gpu<physical index>": the token makes a
//     forged or stale handle fail, the index tells an importer which GPU the memory is on.
//
// Modules: the device cannot run GPU code. cuModuleLoadData accepts an image that is one
// NUL-terminated string, "RINGDEMU" followed by kernel names separated by commas or whitespace
// (e.g. "RINGDEMU" "ringd_spin"), and binds each name to a CPU implementation:
//   ringd_spin(unsigned long long us)  keeps the stream busy for `us` microseconds (a GPU spin).
// Any other image is CUDA_ERROR_INVALID_IMAGE; a name without an implementation is
// CUDA_ERROR_NO_BINARY_FOR_GPU.
#include <cuda.h>

#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <vector>

#define EMU_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

using namespace std::chrono_literals;

constexpr int kDriverVersion = 13000;
constexpr size_t kGranularity = size_t{2} << 20;  // VMM granularity and cuMemAlloc rounding
constexpr int kMaxDevices = 16;
constexpr int kDefaultDevices = 2;
constexpr std::string_view kMemfdPrefix = "ringd-emu-cuda:";
constexpr std::string_view kImageMagic = "RINGDEMU";
constexpr char kIpcMagic[8] = {'R', 'I', 'N', 'G', 'D', 'I', 'P', 'C'};
constexpr const char *kBanner = "ringd software CUDA device";

// ---------------------------------------------------------------------------------------------
// Devices

// 16 bytes fixed across processes: "RINGDEMU", zeros, the physical index in the last two bytes.
CUuuid device_uuid(int phys) {
    CUuuid u{};
    std::memcpy(u.bytes, kImageMagic.data(), 8);
    u.bytes[14] = static_cast<char>((phys >> 8) & 0xff);
    u.bytes[15] = static_cast<char>(phys & 0xff);
    return u;
}

// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi and CUDA_VISIBLE_DEVICES write it.
std::string uuid_string(const CUuuid &u) {
    std::string s = "GPU-";
    char hex[3];
    for (int i = 0; i < 16; ++i) {
        if (i == 4 || i == 6 || i == 8 || i == 10) s += '-';
        std::snprintf(hex, sizeof hex, "%02x", static_cast<unsigned char>(u.bytes[i]));
        s += hex;
    }
    return s;
}

bool all_digits(std::string_view s) {
    return !s.empty() && s.size() <= 9 && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// CUDA_VISIBLE_DEVICES as the driver reads it: physical indices or (unique prefixes of) UUID
// strings; the first invalid or repeated entry ends the list.
std::vector<int> visible_devices(const char *env, int physical) {
    std::vector<int> out;
    if (!env) {
        for (int i = 0; i < physical; ++i) out.push_back(i);
        return out;
    }
    const std::string_view list(env);
    for (size_t pos = 0;;) {
        const size_t comma = list.find(',', pos);
        std::string_view tok = list.substr(pos, comma == std::string_view::npos ? list.npos : comma - pos);
        while (!tok.empty() && (tok.front() == ' ' || tok.front() == '\t')) tok.remove_prefix(1);
        while (!tok.empty() && (tok.back() == ' ' || tok.back() == '\t')) tok.remove_suffix(1);
        int phys = -1;
        if (all_digits(tok)) {
            const int i = std::atoi(std::string(tok).c_str());
            if (i < physical) phys = i;
        } else if (tok.size() > 4 && tok.substr(0, 4) == "GPU-") {
            for (int i = 0; i < physical; ++i) {
                const std::string u = uuid_string(device_uuid(i));
                const bool match = tok.size() <= u.size() &&
                                   std::equal(tok.begin(), tok.end(), u.begin(), [](char a, char b) {
                                       return std::tolower(static_cast<unsigned char>(a)) ==
                                              std::tolower(static_cast<unsigned char>(b));
                                   });
                if (!match) continue;
                if (phys >= 0) {  // an ambiguous prefix is invalid
                    phys = -1;
                    break;
                }
                phys = i;
            }
        }
        if (phys < 0 || std::find(out.begin(), out.end(), phys) != out.end()) break;
        out.push_back(phys);
        if (comma == std::string_view::npos) break;
        pos = comma + 1;
    }
    return out;
}

// ---------------------------------------------------------------------------------------------
// Objects

struct Stream;

struct Context {  // a device's primary context; the CUcontext handle is its address
    int ordinal = 0;
    int phys = 0;
    std::atomic<int> refs{0};
    std::atomic<int> sticky{CUDA_SUCCESS};  // the error a device fault left (cleared with the context)
    std::shared_ptr<Stream> legacy;         // the legacy default stream, made on demand (State::mu)
};

enum class Origin { Alloc, Ipc, Vmm, Registered, AllocHost };

// A span of memory a CUdeviceptr may address: device memory (cuMemAlloc, IPC-opened, a VMM
// mapping with access set) or page-locked host memory (registered, cuMemAllocHost).
inline uint64_t next_buffer_id() {
    static std::atomic<uint64_t> next{1};
    return next++;
}

struct Range {
    uint64_t buffer_id = next_buffer_id();  // CU_POINTER_ATTRIBUTE_BUFFER_ID: never the same twice in a process
    uintptr_t base = 0;
    size_t size = 0;
    Origin origin = Origin::Alloc;
    int phys = -1;           // the GPU the memory is on (device memory)
    Context *ctx = nullptr;  // the context that allocated, opened or registered it; null for VMM
    bool writable = true;
    unsigned handle_types = 0;  // VMM: the allocation's shareable handle types
    uintptr_t span_base = 0;    // VMM: the reservation (CU_POINTER_ATTRIBUTE_RANGE_*)
    size_t span_size = 0;
    // What retire() unmaps and closes.
    void *map_base = nullptr;
    size_t map_len = 0;
    int fd = -1;
    uint64_t token = 0;  // cuMemAlloc / IPC-opened: the memfd's token
    int ipc_refs = 0;    // IPC-opened: opens not yet closed
    // Stream operations that touch the memory bracket the access with `users`; freeing sets
    // `revoked` and waits for `users` to drain, so no operation runs on unmapped memory.
    std::atomic<int> users{0};
    std::atomic<bool> revoked{false};

    bool device() const { return origin == Origin::Alloc || origin == Origin::Ipc || origin == Origin::Vmm; }
};

// A VMM physical allocation (cuMemCreate / cuMemImportFromShareableHandle).
struct Phys {
    int fd = -1;
    size_t size = 0;
    int phys = 0;
    unsigned handle_types = 0;
    ~Phys() {
        if (fd >= 0) ::close(fd);
    }
};

struct VmmMapping {
    size_t size = 0;
    std::shared_ptr<Phys> phys;
    int prot = PROT_NONE;
    std::shared_ptr<Range> access;  // the device range, while access is set
};

struct Reservation {
    size_t size = 0;
    std::map<uintptr_t, VmmMapping> maps;
};

struct Op {
    unsigned delay_us = 0;  // ringd_emu_stream_delay at enqueue time
    std::function<void(Stream &)> run;
};

struct Stream {
    Context *ctx = nullptr;
    unsigned flags = 0;
    std::mutex mu;
    std::condition_variable work;  // an operation queued, closing or cancel
    std::condition_variable done;  // an operation completed, or the worker exited
    std::deque<Op> queue;
    uint64_t enqueued = 0;
    uint64_t completed = 0;
    unsigned delay_us = 0;
    bool closing = false;  // cuStreamDestroy: run what is queued, then exit
    bool exited = false;
    std::atomic<bool> cancel{false};  // the context is gone: drop what is queued
};

struct Event {
    Context *ctx = nullptr;
    unsigned flags = 0;
    std::shared_ptr<Stream> stream;  // the last record; null: never recorded
    uint64_t seq = 0;
};

enum class Kernel { Spin };

struct Module;
struct Function {
    Module *module = nullptr;
    Kernel kernel = Kernel::Spin;
    std::string name;
};

struct Module {
    Context *ctx = nullptr;
    std::vector<std::unique_ptr<Function>> functions;
};

struct State {
    std::mutex mu;  // every table below
    std::atomic<bool> initialized{false};
    int physical = 0;
    std::vector<int> visible;  // ordinal -> physical index
    std::array<Context, kMaxDevices> contexts;
    std::map<uintptr_t, std::shared_ptr<Range>> ranges;  // by base; never overlapping
    std::unordered_map<uint64_t, std::shared_ptr<Range>> ipc_open;  // IPC-opened, by token
    std::unordered_map<uint64_t, std::shared_ptr<Phys>> handles;    // VMM handles
    uint64_t next_handle = 1;
    std::map<uintptr_t, Reservation> reservations;
    std::unordered_map<Stream *, std::shared_ptr<Stream>> streams;
    std::vector<std::weak_ptr<Stream>> draining;  // destroyed, still running what was queued
    std::unordered_map<Event *, std::unique_ptr<Event>> events;
    std::unordered_map<Module *, std::unique_ptr<Module>> modules;
    std::unordered_map<Function *, Module *> functions;
};

// Never destroyed: detached stream workers may still run at process exit.
State &g = *new State;

thread_local Context *tl_ctx = nullptr;

// ---------------------------------------------------------------------------------------------
// Faults injected by ringd_emu_inject_fault

enum FaultKind { kFaultAlloc, kFaultIpcOpen, kFaultImport, kFaultHostRegister, kFaultKinds };
constexpr const char *kFaultNames[kFaultKinds] = {"alloc", "ipc_open", "import", "host_register"};
std::array<std::atomic<int>, kFaultKinds> g_faults{};

bool take_fault(FaultKind k) {
    int v = g_faults[k].load();
    while (v > 0 && !g_faults[k].compare_exchange_weak(v, v - 1)) {
    }
    return v > 0;
}

// ---------------------------------------------------------------------------------------------
// Helpers

#define EMU_TRY(expr)                                                \
    do {                                                             \
        if (const CUresult emu_r_ = (expr); emu_r_ != CUDA_SUCCESS) \
            return emu_r_;                                           \
    } while (0)

CUresult need_init() { return g.initialized.load() ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED; }

CUresult current(Context *&c) {
    c = tl_ctx;
    return c && c->refs.load() > 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

CUresult device_of(CUdevice dev, int &phys) {
    if (dev < 0 || dev >= static_cast<int>(g.visible.size())) return CUDA_ERROR_INVALID_DEVICE;
    phys = g.visible[dev];
    return CUDA_SUCCESS;
}

int ordinal_of(int phys) {
    const auto it = std::find(g.visible.begin(), g.visible.end(), phys);
    return it == g.visible.end() ? -1 : static_cast<int>(it - g.visible.begin());
}

Context *context_of(CUcontext h) {
    auto *c = reinterpret_cast<Context *>(h);
    if (c < g.contexts.data() || c >= g.contexts.data() + g.visible.size()) return nullptr;
    return c;
}

size_t page_size() {
    static const size_t p = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    return p;
}

bool round_up(size_t n, size_t to, size_t &out) {
    if (n > SIZE_MAX - (to - 1)) return false;
    out = (n + to - 1) / to * to;
    return true;
}

uint64_t random_token() {
    uint64_t t = 0;
    if (::getrandom(&t, sizeof t, 0) != static_cast<ssize_t>(sizeof t)) {
        static std::atomic<uint64_t> counter{0};
        t = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
            (static_cast<uint64_t>(::getpid()) << 40) ^ (++counter * 0x9e3779b97f4a7c15ULL);
    }
    return t ? t : 1;
}

std::string memfd_name(uint64_t token, int phys) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.*s%016llx:gpu%d", static_cast<int>(kMemfdPrefix.size()), kMemfdPrefix.data(),
                  static_cast<unsigned long long>(token), phys);
    return buf;
}

// The memfd name of an open fd ("" when it is not a memfd), from /proc/self/fd.
std::string memfd_name_of(int fd) {
    char path[64];
    std::snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    char buf[512];
    const ssize_t n = ::readlink(path, buf, sizeof buf - 1);
    if (n <= 0) return {};
    std::string_view link(buf, static_cast<size_t>(n));
    constexpr std::string_view kMemfd = "/memfd:", kDeleted = " (deleted)";
    if (link.substr(0, kMemfd.size()) != kMemfd) return {};
    link.remove_prefix(kMemfd.size());
    if (link.size() >= kDeleted.size() && link.substr(link.size() - kDeleted.size()) == kDeleted)
        link.remove_suffix(kDeleted.size());
    return std::string(link);
}

// Token and physical device of one of this library's memfd names.
bool parse_memfd_name(const std::string &name, uint64_t &token, int &phys) {
    if (name.compare(0, kMemfdPrefix.size(), kMemfdPrefix) != 0) return false;
    unsigned long long t = 0;
    int p = -1;
    if (std::sscanf(name.c_str() + kMemfdPrefix.size(), "%16llx:gpu%d", &t, &p) != 2) return false;
    if (memfd_name(t, p) != name) return false;
    token = t;
    phys = p;
    return true;
}

CUresult errno_result(int e) { return e == ENOMEM || e == EMFILE || e == ENFILE ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_ERROR_OPERATING_SYSTEM; }

// A memfd of `len` bytes for GPU `phys`.
CUresult create_memfd(size_t len, int phys, int &fd, uint64_t &token) {
    token = random_token();
    fd = ::memfd_create(memfd_name(token, phys).c_str(), MFD_CLOEXEC);
    if (fd < 0) return errno_result(errno);
    if (::ftruncate(fd, static_cast<off_t>(len)) != 0) {
        const int e = errno;
        ::close(fd);
        fd = -1;
        return e == EFBIG || e == EINVAL ? CUDA_ERROR_OUT_OF_MEMORY : errno_result(e);
    }
    return CUDA_SUCCESS;
}

// State::mu held. The range holding `p`, or null.
std::shared_ptr<Range> range_at(uintptr_t p) {
    auto it = g.ranges.upper_bound(p);
    if (it == g.ranges.begin()) return nullptr;
    --it;
    return p - it->second->base < it->second->size ? it->second : nullptr;
}

// State::mu held. Whether any range overlaps [p, p + n); the last one starting below p + n is
// the only one that can (ranges never overlap).
std::shared_ptr<Range> range_overlapping(uintptr_t p, size_t n) {
    auto it = g.ranges.lower_bound(p + n);
    if (it == g.ranges.begin()) return nullptr;
    --it;
    return it->second->base + it->second->size > p ? it->second : nullptr;
}

// State::mu held. The memory a device pointer argument addresses: [p, p + n) inside device memory
// or inside page-locked host memory (a unified address); CUDA_ERROR_INVALID_VALUE otherwise.
CUresult memory_span(uintptr_t p, size_t n, bool write, std::shared_ptr<Range> &out) {
    auto r = range_at(p);
    if (!r || n > r->size - (p - r->base)) return CUDA_ERROR_INVALID_VALUE;
    if (write && !r->writable) return CUDA_ERROR_INVALID_VALUE;
    out = std::move(r);
    return CUDA_SUCCESS;
}

// Take `r` out of use: wait for operations touching it, then unmap and close what it owns.
// Bounded: touching operations are copies, or waits that check `revoked` on every poll.
void retire(Range &r) {
    r.revoked.store(true);
    while (r.users.load() != 0) std::this_thread::sleep_for(10us);
    if (r.map_base) ::munmap(r.map_base, r.map_len);
    if (r.fd >= 0) ::close(r.fd);
    r.map_base = nullptr;
    r.fd = -1;
}

// ---------------------------------------------------------------------------------------------
// Streams

// A device fault: memory an operation needed was freed or unmapped before the operation ran.
void device_fault(Stream &s, const char *what, uintptr_t addr) {
    std::fprintf(stderr, "%s: %s at 0x%llx: the memory was freed or unmapped (an illegal address on a GPU)\n", kBanner,
                 what, static_cast<unsigned long long>(addr));
    int expected = CUDA_SUCCESS;
    s.ctx->sticky.compare_exchange_strong(expected, CUDA_ERROR_ILLEGAL_ADDRESS);
}

// Runs `access` while `r` cannot be unmapped; false when it already was.
template <typename F>
bool touch(Range &r, F &&access) {
    r.users.fetch_add(1);
    if (r.revoked.load()) {
        r.users.fetch_sub(1);
        return false;
    }
    access();
    r.users.fetch_sub(1);
    return true;
}

// Sleeps `d` on the stream's worker, cut short when the stream is cancelled.
void stream_pause(Stream &s, std::chrono::microseconds d) {
    std::unique_lock lk(s.mu);
    s.work.wait_for(lk, d, [&] { return s.cancel.load(); });
}

void worker(std::shared_ptr<Stream> s) {
    std::unique_lock lk(s->mu);
    for (;;) {
        s->work.wait(lk, [&] { return !s->queue.empty() || s->closing || s->cancel.load(); });
        if (s->cancel.load()) {
            s->queue.clear();
            s->completed = s->enqueued;
            break;
        }
        if (s->queue.empty()) break;  // destroyed and drained
        Op op = std::move(s->queue.front());
        s->queue.pop_front();
        lk.unlock();
        if (op.delay_us) stream_pause(*s, std::chrono::microseconds(op.delay_us));
        if (!s->cancel.load()) op.run(*s);
        op = Op{};  // drop what the operation held before it counts as done
        lk.lock();
        ++s->completed;
        s->done.notify_all();
    }
    s->exited = true;
    s->done.notify_all();
}

std::shared_ptr<Stream> make_stream(Context *ctx, unsigned flags) {
    auto s = std::make_shared<Stream>();
    s->ctx = ctx;
    s->flags = flags;
    std::thread(worker, s).detach();
    return s;
}

// State::mu held.
std::shared_ptr<Stream> legacy_stream(Context *c) {
    if (!c->legacy) c->legacy = make_stream(c, 0);
    return c->legacy;
}

// The stream a CUstream names: 0 and CU_STREAM_LEGACY are the current context's legacy stream.
CUresult resolve_stream(CUstream h, std::shared_ptr<Stream> &out) {
    if (h == CU_STREAM_PER_THREAD) return CUDA_ERROR_NOT_SUPPORTED;  // per-thread default streams
    std::lock_guard lk(g.mu);
    if (h == nullptr || h == CU_STREAM_LEGACY) {
        Context *c;
        EMU_TRY(current(c));
        out = legacy_stream(c);
        return CUDA_SUCCESS;
    }
    const auto it = g.streams.find(reinterpret_cast<Stream *>(h));
    if (it == g.streams.end()) return CUDA_ERROR_INVALID_HANDLE;
    out = it->second;
    return CUDA_SUCCESS;
}

CUresult enqueue(Stream &s, std::function<void(Stream &)> run, uint64_t *seq = nullptr) {
    std::lock_guard lk(s.mu);
    if (s.closing || s.cancel.load()) return CUDA_ERROR_INVALID_HANDLE;
    s.queue.push_back(Op{s.delay_us, std::move(run)});
    ++s.enqueued;
    if (seq) *seq = s.enqueued;
    s.work.notify_one();
    return CUDA_SUCCESS;
}

void wait_for(Stream &s, uint64_t seq) {
    std::unique_lock lk(s.mu);
    s.done.wait(lk, [&] { return s.completed >= seq; });
}

void drain(Stream &s) {
    uint64_t seq;
    {
        std::lock_guard lk(s.mu);
        seq = s.enqueued;
    }
    wait_for(s, seq);
}

CUresult sticky(const Context *c) { return static_cast<CUresult>(c->sticky.load()); }

// ---------------------------------------------------------------------------------------------
// Initialisation

CUresult initialize() {
    int physical = kDefaultDevices;
    if (const char *e = std::getenv("RINGD_CUDA_EMULATED_DEVICES"); e && *e) {
        physical = all_digits(e) ? std::atoi(e) : 0;
        if (physical < 1 || physical > kMaxDevices) {
            std::fprintf(stderr, "%s: RINGD_CUDA_EMULATED_DEVICES=%s is not a number from 1 to %d\n", kBanner, e,
                         kMaxDevices);
            return CUDA_ERROR_INVALID_VALUE;
        }
    }
    std::lock_guard lk(g.mu);
    g.physical = physical;
    g.visible = visible_devices(std::getenv("CUDA_VISIBLE_DEVICES"), physical);
    if (g.visible.empty()) return CUDA_ERROR_NO_DEVICE;
    for (size_t i = 0; i < g.visible.size(); ++i) {
        g.contexts[i].ordinal = static_cast<int>(i);
        g.contexts[i].phys = g.visible[i];
    }
    std::fprintf(stderr, "%s: %zu emulated GPU(s) \u2014 a test device, not a GPU\n", kBanner, g.visible.size());
    g.initialized.store(true);
    return CUDA_SUCCESS;
}

// fork(): the child keeps the library's state (contexts, memory) but none of the stream workers,
// so it drops the inherited streams and events (their locks may have been held by a worker).
// Objects leaked on purpose: destroying them could touch a lock a vanished thread held.
void before_fork() { g.mu.lock(); }
void after_fork_parent() { g.mu.unlock(); }
void after_fork_child() {
    static auto *orphans = new std::vector<std::shared_ptr<Stream>>;
    for (auto &[p, s] : g.streams) orphans->push_back(s);
    g.streams.clear();
    for (auto &w : g.draining)
        if (auto s = w.lock()) orphans->push_back(std::move(s));
    g.draining.clear();
    for (auto &c : g.contexts)
        if (c.legacy) orphans->push_back(std::move(c.legacy));
    for (auto &[p, e] : g.events) {
        if (e->stream) orphans->push_back(e->stream);
        (void)e.release();
    }
    g.events.clear();
    for (auto &[b, r] : g.ranges) r->users.store(0);
    g.mu.unlock();
}
[[maybe_unused]] const int g_atfork = ::pthread_atfork(before_fork, after_fork_parent, after_fork_child);

// ---------------------------------------------------------------------------------------------
// Errors

struct ErrorText {
    CUresult code;
    const char *name;
    const char *text;
};

#define EMU_ERR(code, text) {code, #code, text}
constexpr ErrorText kErrors[] = {
    EMU_ERR(CUDA_SUCCESS, "no error"),
    EMU_ERR(CUDA_ERROR_INVALID_VALUE, "invalid argument"),
    EMU_ERR(CUDA_ERROR_OUT_OF_MEMORY, "out of memory"),
    EMU_ERR(CUDA_ERROR_NOT_INITIALIZED, "initialization error"),
    EMU_ERR(CUDA_ERROR_DEINITIALIZED, "driver shutting down"),
    EMU_ERR(CUDA_ERROR_PROFILER_DISABLED, "profiler disabled while using external profiling tool"),
    EMU_ERR(CUDA_ERROR_PROFILER_NOT_INITIALIZED, "profiler not initialized"),
    EMU_ERR(CUDA_ERROR_PROFILER_ALREADY_STARTED, "profiler already started"),
    EMU_ERR(CUDA_ERROR_PROFILER_ALREADY_STOPPED, "profiler already stopped"),
    EMU_ERR(CUDA_ERROR_STUB_LIBRARY, "CUDA driver is a stub library"),
    EMU_ERR(CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER, "the call requires a newer driver"),
    EMU_ERR(CUDA_ERROR_DEVICE_UNAVAILABLE, "CUDA-capable device(s) is/are busy or unavailable"),
    EMU_ERR(CUDA_ERROR_NO_DEVICE, "no CUDA-capable device is detected"),
    EMU_ERR(CUDA_ERROR_INVALID_DEVICE, "invalid device ordinal"),
    EMU_ERR(CUDA_ERROR_DEVICE_NOT_LICENSED, "device doesn't have a valid grid license"),
    EMU_ERR(CUDA_ERROR_INVALID_IMAGE, "device kernel image is invalid"),
    EMU_ERR(CUDA_ERROR_INVALID_CONTEXT, "invalid device context"),
    EMU_ERR(CUDA_ERROR_CONTEXT_ALREADY_CURRENT, "context already current"),
    EMU_ERR(CUDA_ERROR_MAP_FAILED, "mapping of buffer object failed"),
    EMU_ERR(CUDA_ERROR_UNMAP_FAILED, "unmapping of buffer object failed"),
    EMU_ERR(CUDA_ERROR_ARRAY_IS_MAPPED, "array is mapped"),
    EMU_ERR(CUDA_ERROR_ALREADY_MAPPED, "resource already mapped"),
    EMU_ERR(CUDA_ERROR_NO_BINARY_FOR_GPU, "no kernel image is available for execution on the device"),
    EMU_ERR(CUDA_ERROR_ALREADY_ACQUIRED, "resource already acquired"),
    EMU_ERR(CUDA_ERROR_NOT_MAPPED, "resource not mapped"),
    EMU_ERR(CUDA_ERROR_NOT_MAPPED_AS_ARRAY, "resource not mapped as array"),
    EMU_ERR(CUDA_ERROR_NOT_MAPPED_AS_POINTER, "resource not mapped as pointer"),
    EMU_ERR(CUDA_ERROR_ECC_UNCORRECTABLE, "uncorrectable ECC error encountered"),
    EMU_ERR(CUDA_ERROR_UNSUPPORTED_LIMIT, "limit is not supported on this architecture"),
    EMU_ERR(CUDA_ERROR_CONTEXT_ALREADY_IN_USE, "exclusive-thread device already in use by a different thread"),
    EMU_ERR(CUDA_ERROR_PEER_ACCESS_UNSUPPORTED, "peer access is not supported between these two devices"),
    EMU_ERR(CUDA_ERROR_INVALID_PTX, "a PTX JIT compilation failed"),
    EMU_ERR(CUDA_ERROR_INVALID_GRAPHICS_CONTEXT, "invalid OpenGL or DirectX context"),
    EMU_ERR(CUDA_ERROR_NVLINK_UNCORRECTABLE, "uncorrectable NVLink error detected"),
    EMU_ERR(CUDA_ERROR_JIT_COMPILER_NOT_FOUND, "PTX JIT compiler library not found"),
    EMU_ERR(CUDA_ERROR_UNSUPPORTED_PTX_VERSION, "the PTX was compiled with an unsupported toolchain"),
    EMU_ERR(CUDA_ERROR_JIT_COMPILATION_DISABLED, "PTX JIT compilation was disabled"),
    EMU_ERR(CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY, "the execution affinity is not supported"),
    EMU_ERR(CUDA_ERROR_UNSUPPORTED_DEVSIDE_SYNC, "the code calls an unsupported device-side synchronisation"),
    EMU_ERR(CUDA_ERROR_CONTAINED, "an error was contained to the faulting context"),
    EMU_ERR(CUDA_ERROR_INVALID_SOURCE, "device kernel image is invalid"),
    EMU_ERR(CUDA_ERROR_FILE_NOT_FOUND, "file not found"),
    EMU_ERR(CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND, "shared object symbol not found"),
    EMU_ERR(CUDA_ERROR_SHARED_OBJECT_INIT_FAILED, "shared object initialization failed"),
    EMU_ERR(CUDA_ERROR_OPERATING_SYSTEM, "OS call failed or operation not supported on this OS"),
    EMU_ERR(CUDA_ERROR_INVALID_HANDLE, "invalid resource handle"),
    EMU_ERR(CUDA_ERROR_ILLEGAL_STATE, "the operation cannot be performed in the present state"),
    EMU_ERR(CUDA_ERROR_LOSSY_QUERY, "the query would yield lossy results"),
    EMU_ERR(CUDA_ERROR_NOT_FOUND, "named symbol not found"),
    EMU_ERR(CUDA_ERROR_NOT_READY, "device not ready"),
    EMU_ERR(CUDA_ERROR_ILLEGAL_ADDRESS, "an illegal memory access was encountered"),
    EMU_ERR(CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, "too many resources requested for launch"),
    EMU_ERR(CUDA_ERROR_LAUNCH_TIMEOUT, "the launch timed out and was terminated"),
    EMU_ERR(CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING, "launch uses incompatible texturing mode"),
    EMU_ERR(CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED, "peer access is already enabled"),
    EMU_ERR(CUDA_ERROR_PEER_ACCESS_NOT_ENABLED, "peer access has not been enabled"),
    EMU_ERR(CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE, "cannot set while device is active in this process"),
    EMU_ERR(CUDA_ERROR_CONTEXT_IS_DESTROYED, "context is destroyed"),
    EMU_ERR(CUDA_ERROR_ASSERT, "device-side assert triggered"),
    EMU_ERR(CUDA_ERROR_TOO_MANY_PEERS, "peer mapping resources exhausted"),
    EMU_ERR(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, "part or all of the requested memory range is already mapped"),
    EMU_ERR(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, "pointer does not correspond to a registered memory region"),
    EMU_ERR(CUDA_ERROR_HARDWARE_STACK_ERROR, "hardware stack error"),
    EMU_ERR(CUDA_ERROR_ILLEGAL_INSTRUCTION, "an illegal instruction was encountered"),
    EMU_ERR(CUDA_ERROR_MISALIGNED_ADDRESS, "misaligned address"),
    EMU_ERR(CUDA_ERROR_INVALID_ADDRESS_SPACE, "operation not supported on global/shared address space"),
    EMU_ERR(CUDA_ERROR_INVALID_PC, "invalid program counter"),
    EMU_ERR(CUDA_ERROR_LAUNCH_FAILED, "unspecified launch failure"),
    EMU_ERR(CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE, "too many blocks in cooperative launch"),
    EMU_ERR(CUDA_ERROR_TENSOR_MEMORY_LEAK, "tensor memory not completely freed"),
    EMU_ERR(CUDA_ERROR_NOT_PERMITTED, "operation not permitted"),
    EMU_ERR(CUDA_ERROR_NOT_SUPPORTED, "operation not supported"),
    EMU_ERR(CUDA_ERROR_SYSTEM_NOT_READY, "system not yet initialized"),
    EMU_ERR(CUDA_ERROR_SYSTEM_DRIVER_MISMATCH, "system has unsupported display driver / cuda driver combination"),
    EMU_ERR(CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE, "forward compatibility was attempted on non supported HW"),
    EMU_ERR(CUDA_ERROR_MPS_CONNECTION_FAILED, "MPS client failed to connect to the MPS control daemon or server"),
    EMU_ERR(CUDA_ERROR_MPS_RPC_FAILURE, "the remote procedure call between the MPS server and client failed"),
    EMU_ERR(CUDA_ERROR_MPS_SERVER_NOT_READY, "MPS server is not ready to accept new MPS client requests"),
    EMU_ERR(CUDA_ERROR_MPS_MAX_CLIENTS_REACHED, "the hardware resources required to create an MPS client are exhausted"),
    EMU_ERR(CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED, "the hardware resources required for device connections are exhausted"),
    EMU_ERR(CUDA_ERROR_MPS_CLIENT_TERMINATED, "the MPS client has been terminated by the server"),
    EMU_ERR(CUDA_ERROR_CDP_NOT_SUPPORTED, "CUDA Dynamic Parallelism is not supported in this configuration"),
    EMU_ERR(CUDA_ERROR_CDP_VERSION_MISMATCH, "unsupported mix of CUDA Dynamic Parallelism versions"),
    EMU_ERR(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "operation not permitted when stream is capturing"),
    EMU_ERR(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "operation failed due to a previous error during capture"),
    EMU_ERR(CUDA_ERROR_STREAM_CAPTURE_MERGE, "operation would result in a merge of separate capture sequences"),
    EMU_ERR(CUDA_ERROR_STREAM_CAPTURE_UNMATCHED, "capture was not ended in the same stream as it began"),
    EMU_ERR(CUDA_ERROR_STREAM_CAPTURE_UNJOINED, "capturing stream has unjoined work"),
    EMU_ERR(CUDA_ERROR_STREAM_CAPTURE_ISOLATION, "dependency created on uncaptured work in another stream"),
    EMU_ERR(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, "operation would make the legacy stream depend on a capturing blocking stream"),
    EMU_ERR(CUDA_ERROR_CAPTURED_EVENT, "operation not permitted on an event last recorded in a capturing stream"),
    EMU_ERR(CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD, "attempt to terminate a thread-local capture sequence from another thread"),
    EMU_ERR(CUDA_ERROR_TIMEOUT, "wait operation timed out"),
    EMU_ERR(CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE, "the graph update was not performed"),
    EMU_ERR(CUDA_ERROR_EXTERNAL_DEVICE, "an async error has occurred in an external entity outside of CUDA"),
    EMU_ERR(CUDA_ERROR_INVALID_CLUSTER_SIZE, "a kernel launch error has occurred due to cluster misconfiguration"),
    EMU_ERR(CUDA_ERROR_FUNCTION_NOT_LOADED, "the function handle is not loaded"),
    EMU_ERR(CUDA_ERROR_INVALID_RESOURCE_TYPE, "one or more resources are not valid resource types for the operation"),
    EMU_ERR(CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION, "one or more resources are insufficient or non-applicable"),
    EMU_ERR(CUDA_ERROR_KEY_ROTATION, "an error happened during the key rotation sequence"),
    EMU_ERR(CUDA_ERROR_UNKNOWN, "unknown error"),
};
#undef EMU_ERR

const ErrorText *error_text(CUresult r) {
    for (const auto &e : kErrors)
        if (e.code == r) return &e;
    return nullptr;
}

// ---------------------------------------------------------------------------------------------
// The API. Each function has the signature cuda.h gives the driver function it stands for (the
// proc table below checks it) and is reached only through cuGetProcAddress.

namespace api {

CUresult DriverGetVersion(int *v) {
    if (!v) return CUDA_ERROR_INVALID_VALUE;
    *v = kDriverVersion;
    return CUDA_SUCCESS;
}

CUresult Init(unsigned int flags) {
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    static std::once_flag once;
    static CUresult result = CUDA_ERROR_NOT_INITIALIZED;
    std::call_once(once, [] { result = initialize(); });
    return result;
}

CUresult GetErrorString(CUresult error, const char **pStr) {
    if (!pStr) return CUDA_ERROR_INVALID_VALUE;
    const ErrorText *e = error_text(error);
    *pStr = e ? e->text : nullptr;
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult GetErrorName(CUresult error, const char **pStr) {
    if (!pStr) return CUDA_ERROR_INVALID_VALUE;
    const ErrorText *e = error_text(error);
    *pStr = e ? e->name : nullptr;
    return e ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

// --- devices

CUresult DeviceGetCount(int *count) {
    EMU_TRY(need_init());
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    *count = static_cast<int>(g.visible.size());
    return CUDA_SUCCESS;
}

CUresult DeviceGet(CUdevice *device, int ordinal) {
    EMU_TRY(need_init());
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    int phys = -1;
    EMU_TRY(device_of(ordinal, phys));
    *device = ordinal;
    return CUDA_SUCCESS;
}

CUresult DeviceGetUuid(CUuuid *uuid, CUdevice dev) {
    EMU_TRY(need_init());
    if (!uuid) return CUDA_ERROR_INVALID_VALUE;
    int phys = -1;
    EMU_TRY(device_of(dev, phys));
    *uuid = device_uuid(phys);
    return CUDA_SUCCESS;
}

CUresult DeviceGetName(char *name, int len, CUdevice dev) {
    EMU_TRY(need_init());
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    int phys = -1;
    EMU_TRY(device_of(dev, phys));
    std::snprintf(name, static_cast<size_t>(len), "ringd emulated GPU %d", phys);
    return CUDA_SUCCESS;
}

CUresult DeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev) {
    EMU_TRY(need_init());
    if (!pi) return CUDA_ERROR_INVALID_VALUE;
    int phys = -1;
    EMU_TRY(device_of(dev, phys));
    int v;
    switch (attrib) {
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X:
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y: v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z: v = 64; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X: v = INT_MAX; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y:
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z: v = 65535; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: v = 48 << 10; break;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: v = 32; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: v = 8; break;
    case CU_DEVICE_ATTRIBUTE_INTEGRATED: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: v = 0x10 + phys; break;  // one GPU per bus, like real boards
    case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: v = 9; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1:
    case CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS_V1:
    case CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR_V1:
    case CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS:
    case CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR:
    case CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED: v = 1; break;  // host memory: any NIC can register it
    default: return CUDA_ERROR_INVALID_VALUE;
    }
    *pi = v;
    return CUDA_SUCCESS;
}

// --- contexts

CUresult DevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    EMU_TRY(need_init());
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    int phys = -1;
    EMU_TRY(device_of(dev, phys));
    std::lock_guard lk(g.mu);
    Context &c = g.contexts[static_cast<size_t>(dev)];
    if (c.refs.fetch_add(1) == 0) c.sticky.store(CUDA_SUCCESS);
    *pctx = reinterpret_cast<CUcontext>(&c);
    return CUDA_SUCCESS;
}

// The last release destroys the primary context, as the driver does: its streams stop (queued work
// is dropped), its events and modules go, and the memory it allocated, opened or registered is
// freed. VMM memory is not owned by a context and stays.
CUresult DevicePrimaryCtxRelease(CUdevice dev) {
    EMU_TRY(need_init());
    int phys = -1;
    EMU_TRY(device_of(dev, phys));
    std::vector<std::shared_ptr<Stream>> streams;
    std::vector<std::shared_ptr<Range>> memory;
    Context &c = g.contexts[static_cast<size_t>(dev)];
    {
        std::lock_guard lk(g.mu);
        if (c.refs.load() == 0) return CUDA_ERROR_INVALID_CONTEXT;
        if (c.refs.fetch_sub(1) > 1) return CUDA_SUCCESS;
        for (auto it = g.streams.begin(); it != g.streams.end();) {
            if (it->second->ctx == &c) {
                streams.push_back(std::move(it->second));
                it = g.streams.erase(it);
            } else {
                ++it;
            }
        }
        if (c.legacy) streams.push_back(std::move(c.legacy));
        for (auto &w : g.draining)
            if (auto s = w.lock(); s && s->ctx == &c) streams.push_back(std::move(s));
        std::erase_if(g.events, [&](const auto &e) { return e.second->ctx == &c; });
        for (auto it = g.modules.begin(); it != g.modules.end();) {
            if (it->second->ctx == &c) {
                for (auto &f : it->second->functions) g.functions.erase(f.get());
                it = g.modules.erase(it);
            } else {
                ++it;
            }
        }
        for (auto it = g.ranges.begin(); it != g.ranges.end();) {
            if (it->second->ctx == &c) {
                if (it->second->origin == Origin::Ipc) g.ipc_open.erase(it->second->token);
                memory.push_back(std::move(it->second));
                it = g.ranges.erase(it);
            } else {
                ++it;
            }
        }
    }
    for (auto &s : streams) {
        std::lock_guard lk(s->mu);
        s->cancel.store(true);
        s->work.notify_all();
    }
    for (auto &s : streams) {  // a host function running now finishes first
        std::unique_lock lk(s->mu);
        s->done.wait(lk, [&] { return s->exited; });
    }
    for (auto &r : memory) retire(*r);  // other contexts' streams may still be touching it
    return CUDA_SUCCESS;
}

CUresult CtxSetCurrent(CUcontext ctx) {
    EMU_TRY(need_init());
    if (!ctx) {
        tl_ctx = nullptr;
        return CUDA_SUCCESS;
    }
    Context *c = context_of(ctx);
    if (!c || c->refs.load() == 0) return CUDA_ERROR_INVALID_CONTEXT;
    tl_ctx = c;
    return CUDA_SUCCESS;
}

CUresult CtxGetCurrent(CUcontext *pctx) {
    EMU_TRY(need_init());
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    *pctx = reinterpret_cast<CUcontext>(tl_ctx);
    return CUDA_SUCCESS;
}

CUresult CtxGetDevice(CUdevice *device) {
    EMU_TRY(need_init());
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    Context *c;
    EMU_TRY(current(c));
    *device = c->ordinal;
    return CUDA_SUCCESS;
}

CUresult CtxSynchronize() {
    EMU_TRY(need_init());
    Context *c;
    EMU_TRY(current(c));
    std::vector<std::shared_ptr<Stream>> streams;
    {
        std::lock_guard lk(g.mu);
        for (auto &[p, s] : g.streams)
            if (s->ctx == c) streams.push_back(s);
        if (c->legacy) streams.push_back(c->legacy);
    }
    for (auto &s : streams) drain(*s);
    return sticky(c);
}

// --- memory

CUresult PointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr) {
    EMU_TRY(need_init());
    if (!data) return CUDA_ERROR_INVALID_VALUE;
    std::lock_guard lk(g.mu);
    const auto r = range_at(ptr);
    if (!r) return CUDA_ERROR_INVALID_VALUE;
    const bool vmm = r->origin == Origin::Vmm;
    switch (attribute) {
    case CU_POINTER_ATTRIBUTE_CONTEXT:  // VMM memory belongs to no context
        *static_cast<CUcontext *>(data) = reinterpret_cast<CUcontext>(r->ctx);
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
        *static_cast<unsigned int *>(data) = r->device() ? CU_MEMORYTYPE_DEVICE : CU_MEMORYTYPE_HOST;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
        *static_cast<CUdeviceptr *>(data) = ptr;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_HOST_POINTER:
        if (r->device()) return CUDA_ERROR_INVALID_VALUE;  // a GPU's memory has no host address
        *static_cast<void **>(data) = reinterpret_cast<void *>(ptr);
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_BUFFER_ID:
        *static_cast<unsigned long long *>(data) = r->buffer_id;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_IS_MANAGED:
        *static_cast<unsigned int *>(data) = 0;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: {
        const int ordinal = r->device() ? ordinal_of(r->phys) : r->ctx->ordinal;
        if (ordinal < 0) return CUDA_ERROR_INVALID_VALUE;
        *static_cast<int *>(data) = ordinal;
        return CUDA_SUCCESS;
    }
    case CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE:
        *static_cast<unsigned int *>(data) = r->origin == Origin::Alloc;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:  // VMM: the reservation, as documented
        *static_cast<CUdeviceptr *>(data) = vmm ? r->span_base : r->base;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
        *static_cast<size_t *>(data) = vmm ? r->span_size : r->size;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_MAPPED:
        *static_cast<unsigned int *>(data) = 1;
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES:
        *static_cast<unsigned long long *>(data) = r->handle_types;
        return CUDA_SUCCESS;
    default: return CUDA_ERROR_NOT_SUPPORTED;
    }
}

CUresult MemAlloc(CUdeviceptr *dptr, size_t bytesize) {
    EMU_TRY(need_init());
    if (!dptr) return CUDA_ERROR_INVALID_VALUE;
    Context *c;
    EMU_TRY(current(c));
    if (bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
    if (take_fault(kFaultAlloc)) return CUDA_ERROR_OUT_OF_MEMORY;
    size_t len;
    if (!round_up(bytesize, kGranularity, len)) return CUDA_ERROR_OUT_OF_MEMORY;
    auto r = std::make_shared<Range>();
    EMU_TRY(create_memfd(len, c->phys, r->fd, r->token));
    void *p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, r->fd, 0);
    if (p == MAP_FAILED) {
        ::close(r->fd);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    r->base = reinterpret_cast<uintptr_t>(p);
    r->size = bytesize;
    r->origin = Origin::Alloc;
    r->phys = c->phys;
    r->ctx = c;
    r->map_base = p;
    r->map_len = len;
    std::lock_guard lk(g.mu);
    g.ranges[r->base] = r;
    *dptr = r->base;
    return CUDA_SUCCESS;
}

CUresult MemFree(CUdeviceptr dptr) {
    EMU_TRY(need_init());
    Context *c;
    EMU_TRY(current(c));
    std::lock_guard lk(g.mu);
    const auto it = g.ranges.find(dptr);
    if (it == g.ranges.end() || it->second->origin != Origin::Alloc) return CUDA_ERROR_INVALID_VALUE;
    retire(*it->second);
    g.ranges.erase(it);
    return CUDA_SUCCESS;
}

CUresult MemGetAddressRange(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr) {
    EMU_TRY(need_init());
    Context *c;
    EMU_TRY(current(c));
    std::lock_guard lk(g.mu);
    const auto r = range_at(dptr);
    if (!r || !r->device()) return CUDA_ERROR_NOT_FOUND;
    if (pbase) *pbase = r->base;
    if (psize) *psize = r->size;
    return CUDA_SUCCESS;
}

// A copy between host memory and [dev, dev + n) on `s`; `to_device` picks the direction.
CUresult enqueue_copy(Stream &s, uintptr_t dev, void *host, size_t n, bool to_device, uint64_t *seq) {
    std::shared_ptr<Range> r;
    {
        std::lock_guard lk(g.mu);
        EMU_TRY(memory_span(dev, n, to_device, r));
    }
    return enqueue(
        s,
        [r, dev, host, n, to_device](Stream &st) {
            auto *d = reinterpret_cast<void *>(dev);
            if (!touch(*r, [&] { to_device ? std::memcpy(d, host, n) : std::memcpy(host, d, n); }))
                device_fault(st, to_device ? "memcpy to device" : "memcpy from device", dev);
        },
        seq);
}

// Synchronous copies run on the legacy stream, and return when done.
CUresult copy_sync(CUdeviceptr dev, void *host, size_t n, bool to_device) {
    EMU_TRY(need_init());
    std::shared_ptr<Stream> s;
    EMU_TRY(resolve_stream(nullptr, s));
    if (n == 0) return CUDA_SUCCESS;
    uint64_t seq;
    EMU_TRY(enqueue_copy(*s, dev, host, n, to_device, &seq));
    wait_for(*s, seq);
    return sticky(s->ctx);
}

CUresult MemcpyHtoD(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount) {
    return copy_sync(dstDevice, const_cast<void *>(srcHost), ByteCount, true);
}

CUresult MemcpyDtoH(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount) {
    return copy_sync(srcDevice, dstHost, ByteCount, false);
}

CUresult copy_async(CUdeviceptr dev, void *host, size_t n, bool to_device, CUstream h) {
    EMU_TRY(need_init());
    std::shared_ptr<Stream> s;
    EMU_TRY(resolve_stream(h, s));
    if (n == 0) return CUDA_SUCCESS;
    return enqueue_copy(*s, dev, host, n, to_device, nullptr);
}

CUresult MemcpyHtoDAsync(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount, CUstream hStream) {
    return copy_async(dstDevice, const_cast<void *>(srcHost), ByteCount, true, hStream);
}

CUresult MemcpyDtoHAsync(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream) {
    return copy_async(srcDevice, dstHost, ByteCount, false, hStream);
}

// Like the driver's, asynchronous with respect to the host unless the target is page-locked host
// memory: it runs on the legacy stream.
CUresult MemsetD8(CUdeviceptr dstDevice, unsigned char uc, size_t N) {
    EMU_TRY(need_init());
    std::shared_ptr<Stream> s;
    EMU_TRY(resolve_stream(nullptr, s));
    if (N == 0) return CUDA_SUCCESS;
    std::shared_ptr<Range> r;
    {
        std::lock_guard lk(g.mu);
        EMU_TRY(memory_span(dstDevice, N, true, r));
    }
    const bool host = !r->device();
    uint64_t seq;
    EMU_TRY(enqueue(
        *s,
        [r, dstDevice, uc, N](Stream &st) {
            if (!touch(*r, [&] { std::memset(reinterpret_cast<void *>(dstDevice), uc, N); }))
                device_fault(st, "memset", dstDevice);
        },
        &seq));
    if (host) wait_for(*s, seq);
    return CUDA_SUCCESS;
}

constexpr unsigned kHostRegisterKnown =
    CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_IOMEMORY | CU_MEMHOSTREGISTER_READ_ONLY;

CUresult MemHostRegister(void *p, size_t bytesize, unsigned int Flags) {
    EMU_TRY(need_init());
    Context *c;
    EMU_TRY(current(c));
    if (!p || bytesize == 0 || (Flags & ~kHostRegisterKnown)) return CUDA_ERROR_INVALID_VALUE;
    if (Flags & (CU_MEMHOSTREGISTER_IOMEMORY | CU_MEMHOSTREGISTER_READ_ONLY)) return CUDA_ERROR_NOT_SUPPORTED;
    if (take_fault(kFaultHostRegister)) return CUDA_ERROR_OUT_OF_MEMORY;
    const auto base = reinterpret_cast<uintptr_t>(p);
    if (bytesize > UINTPTR_MAX - base) return CUDA_ERROR_INVALID_VALUE;
    // Pinning fails on addresses that are not mapped; mincore() tells which are.
    const uintptr_t first = base / page_size() * page_size();
    std::vector<unsigned char> vec((base + bytesize - first + page_size() - 1) / page_size());
    if (::mincore(reinterpret_cast<void *>(first), base + bytesize - first, vec.data()) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    std::lock_guard lk(g.mu);
    if (const auto o = range_overlapping(base, bytesize))
        return o->device() ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
    auto r = std::make_shared<Range>();
    r->base = base;
    r->size = bytesize;
    r->origin = Origin::Registered;
    r->ctx = c;
    r->phys = c->phys;
    g.ranges[base] = std::move(r);
    return CUDA_SUCCESS;
}

CUresult MemHostUnregister(void *p) {
    EMU_TRY(need_init());
    Context *c;
    EMU_TRY(current(c));
    std::lock_guard lk(g.mu);
    const auto it = g.ranges.find(reinterpret_cast<uintptr_t>(p));
    if (!p || it == g.ranges.end() || it->second->origin != Origin::Registered)
        return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
    retire(*it->second);
    g.ranges.erase(it);
    return CUDA_SUCCESS;
}

CUresult MemHostGetDevicePointer(CUdeviceptr *pdptr, void *p, unsigned int Flags) {
    EMU_TRY(need_init());
    Context *c;
    EMU_TRY(current(c));
    if (!pdptr || !p || Flags != 0) return CUDA_ERROR_INVALID_VALUE;
    std::lock_guard lk(g.mu);
    const auto r = range_at(reinterpret_cast<uintptr_t>(p));
    if (!r || r->device()) return CUDA_ERROR_INVALID_VALUE;
    *pdptr = reinterpret_cast<CUdeviceptr>(p);  // unified addressing: the same address
    return CUDA_SUCCESS;
}

CUresult MemAllocHost(void **pp, size_t bytesize) {
    EMU_TRY(need_init());
    Context *c;
    EMU_TRY(current(c));
    if (!pp || bytesize == 0) return CUDA_ERROR_INVALID_VALUE;
    size_t len;
    if (!round_up(bytesize, page_size(), len)) return CUDA_ERROR_OUT_OF_MEMORY;
    void *p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    auto r = std::make_shared<Range>();
    r->base = reinterpret_cast<uintptr_t>(p);
    r->size = bytesize;
    r->origin = Origin::AllocHost;
    r->ctx = c;
    r->phys = c->phys;
    r->map_base = p;
    r->map_len = len;
    std::lock_guard lk(g.mu);
    g.ranges[r->base] = std::move(r);
    *pp = p;
    return CUDA_SUCCESS;
}

CUresult MemFreeHost(void *p) {
    EMU_TRY(need_init());
    Context *c;
    EMU_TRY(current(c));
    std::lock_guard lk(g.mu);
    const auto it = g.ranges.find(reinterpret_cast<uintptr_t>(p));
    if (!p || it == g.ranges.end() || it->second->origin != Origin::AllocHost) return CUDA_ERROR_INVALID_VALUE;
    retire(*it->second);
    g.ranges.erase(it);
    return CUDA_SUCCESS;
}

// --- legacy IPC

// The 64 bytes of a CUipcMemHandle. The exporter's memfd is reached through /proc/<pid>/fd/<fd>;
// the token in its name must match, so a stale or forged handle never maps other memory.
struct IpcHandle {
    char magic[8];
    int32_t pid;
    int32_t fd;
    uint64_t size;
    uint32_t phys;
    uint32_t reserved;
    uint64_t token;
    char pad[24];
};
static_assert(sizeof(IpcHandle) == sizeof(CUipcMemHandle));

CUresult IpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr) {
    EMU_TRY(need_init());
    if (!pHandle) return CUDA_ERROR_INVALID_VALUE;
    Context *c;
    EMU_TRY(current(c));
    std::lock_guard lk(g.mu);
    const auto it = g.ranges.find(dptr);
    if (it == g.ranges.end() || it->second->origin != Origin::Alloc) return CUDA_ERROR_INVALID_VALUE;
    const Range &r = *it->second;
    IpcHandle h{};
    std::memcpy(h.magic, kIpcMagic, sizeof h.magic);
    h.pid = ::getpid();
    h.fd = r.fd;
    h.size = r.size;
    h.phys = static_cast<uint32_t>(r.phys);
    h.token = r.token;
    std::memcpy(pHandle, &h, sizeof h);
    return CUDA_SUCCESS;
}

// Opening a handle already open in this process returns the same address and counts the open
// (cuIpcCloseMemHandle unmaps at the last close), as current drivers do.
CUresult IpcOpenMemHandle(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags) {
    EMU_TRY(need_init());
    if (!pdptr || (Flags & ~static_cast<unsigned>(CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS))) return CUDA_ERROR_INVALID_VALUE;
    Context *c;
    EMU_TRY(current(c));
    if (take_fault(kFaultIpcOpen)) return CUDA_ERROR_MAP_FAILED;
    IpcHandle h;
    std::memcpy(&h, &handle, sizeof h);
    if (std::memcmp(h.magic, kIpcMagic, sizeof h.magic) != 0 || h.pid <= 0 || h.fd < 0 || h.size == 0 ||
        h.phys >= static_cast<uint32_t>(g.physical))
        return CUDA_ERROR_INVALID_HANDLE;
    if (h.pid == ::getpid()) return CUDA_ERROR_INVALID_CONTEXT;  // the driver refuses it too
    const int phys = static_cast<int>(h.phys);
    // All emulated GPUs share host memory, so peer access is always there; memory of a GPU this
    // process does not see cannot be mapped.
    if (ordinal_of(phys) < 0) return CUDA_ERROR_INVALID_DEVICE;
    size_t len;
    if (!round_up(h.size, kGranularity, len)) return CUDA_ERROR_INVALID_HANDLE;

    std::lock_guard lk(g.mu);
    if (const auto it = g.ipc_open.find(h.token); it != g.ipc_open.end()) {
        ++it->second->ipc_refs;
        *pdptr = it->second->base;
        return CUDA_SUCCESS;
    }
    char path[64];
    std::snprintf(path, sizeof path, "/proc/%d/fd/%d", h.pid, h.fd);
    const int fd = ::open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) return errno == ENOENT || errno == ESRCH ? CUDA_ERROR_INVALID_HANDLE : CUDA_ERROR_MAP_FAILED;
    struct stat st {};
    if (memfd_name_of(fd) != memfd_name(h.token, phys) || ::fstat(fd, &st) != 0 ||
        static_cast<uint64_t>(st.st_size) != len) {
        ::close(fd);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    void *p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) return CUDA_ERROR_MAP_FAILED;
    auto r = std::make_shared<Range>();
    r->base = reinterpret_cast<uintptr_t>(p);
    r->size = h.size;
    r->origin = Origin::Ipc;
    r->phys = phys;
    r->ctx = c;
    r->map_base = p;
    r->map_len = len;
    r->token = h.token;
    r->ipc_refs = 1;
    g.ranges[r->base] = r;
    g.ipc_open[h.token] = r;
    *pdptr = r->base;
    return CUDA_SUCCESS;
}

CUresult IpcCloseMemHandle(CUdeviceptr dptr) {
    EMU_TRY(need_init());
    Context *c;
    EMU_TRY(current(c));
    std::lock_guard lk(g.mu);
    const auto it = g.ranges.find(dptr);
    if (it == g.ranges.end() || it->second->origin != Origin::Ipc) return CUDA_ERROR_INVALID_VALUE;
    Range &r = *it->second;
    if (--r.ipc_refs > 0) return CUDA_SUCCESS;
    g.ipc_open.erase(r.token);
    retire(r);
    g.ranges.erase(it);
    return CUDA_SUCCESS;
}

// --- virtual memory management

CUresult check_prop(const CUmemAllocationProp *prop, int &phys) {
    if (!prop || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED) return CUDA_ERROR_INVALID_VALUE;
    switch (prop->location.type) {
    case CU_MEM_LOCATION_TYPE_DEVICE: EMU_TRY(device_of(prop->location.id, phys)); break;
    case CU_MEM_LOCATION_TYPE_HOST:
    case CU_MEM_LOCATION_TYPE_HOST_NUMA: return CUDA_ERROR_NOT_SUPPORTED;  // host VMM allocations
    default: return CUDA_ERROR_INVALID_VALUE;
    }
    constexpr unsigned kOtherTypes = CU_MEM_HANDLE_TYPE_WIN32 | CU_MEM_HANDLE_TYPE_WIN32_KMT | CU_MEM_HANDLE_TYPE_FABRIC;
    const auto types = static_cast<unsigned>(prop->requestedHandleTypes);
    if (types & ~(kOtherTypes | CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) return CUDA_ERROR_INVALID_VALUE;
    if (types & kOtherTypes) return CUDA_ERROR_NOT_SUPPORTED;
    if (prop->win32HandleMetaData) return CUDA_ERROR_INVALID_VALUE;  // must be null off Windows
    if (prop->allocFlags.compressionType != CU_MEM_ALLOCATION_COMP_NONE || prop->allocFlags.usage != 0)
        return CUDA_ERROR_NOT_SUPPORTED;
    // gpuDirectRDMACapable: granted, the memory is host memory any NIC can register.
    return CUDA_SUCCESS;
}

CUresult MemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                     CUmemAllocationGranularity_flags option) {
    EMU_TRY(need_init());
    if (!granularity) return CUDA_ERROR_INVALID_VALUE;
    int phys = -1;
    EMU_TRY(check_prop(prop, phys));
    if (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM && option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
        return CUDA_ERROR_INVALID_VALUE;
    *granularity = kGranularity;
    return CUDA_SUCCESS;
}

CUresult MemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                   unsigned long long flags) {
    EMU_TRY(need_init());
    if (!handle || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    int phys = -1;
    EMU_TRY(check_prop(prop, phys));
    if (size == 0 || size % kGranularity != 0) return CUDA_ERROR_INVALID_VALUE;
    if (take_fault(kFaultAlloc)) return CUDA_ERROR_OUT_OF_MEMORY;
    auto p = std::make_shared<Phys>();
    uint64_t token = 0;
    EMU_TRY(create_memfd(size, phys, p->fd, token));
    p->size = size;
    p->phys = phys;
    p->handle_types = static_cast<unsigned>(prop->requestedHandleTypes);
    std::lock_guard lk(g.mu);
    const uint64_t id = g.next_handle++;
    g.handles[id] = std::move(p);
    *handle = id;
    return CUDA_SUCCESS;
}

// The memory itself lives on while mapped (each mapping holds the allocation).
CUresult MemRelease(CUmemGenericAllocationHandle handle) {
    EMU_TRY(need_init());
    std::lock_guard lk(g.mu);
    return g.handles.erase(handle) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult MemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                    CUmemAllocationHandleType handleType, unsigned long long flags) {
    EMU_TRY(need_init());
    if (!shareableHandle || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    if (handleType == CU_MEM_HANDLE_TYPE_WIN32 || handleType == CU_MEM_HANDLE_TYPE_WIN32_KMT ||
        handleType == CU_MEM_HANDLE_TYPE_FABRIC)
        return CUDA_ERROR_NOT_SUPPORTED;
    if (handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_INVALID_VALUE;
    std::lock_guard lk(g.mu);
    const auto it = g.handles.find(handle);
    if (it == g.handles.end()) return CUDA_ERROR_INVALID_VALUE;
    // Not created exportable as a POSIX fd: the driver's answer is not documented (INVALID_VALUE
    // or NOT_PERMITTED); this device says INVALID_VALUE, the argument does not fit the handle.
    if (!(it->second->handle_types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) return CUDA_ERROR_INVALID_VALUE;
    const int fd = ::fcntl(it->second->fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return errno_result(errno);
    *static_cast<int *>(shareableHandle) = fd;
    return CUDA_SUCCESS;
}

CUresult MemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                      CUmemAllocationHandleType shHandleType) {
    EMU_TRY(need_init());
    if (!handle) return CUDA_ERROR_INVALID_VALUE;
    if (shHandleType == CU_MEM_HANDLE_TYPE_WIN32 || shHandleType == CU_MEM_HANDLE_TYPE_WIN32_KMT ||
        shHandleType == CU_MEM_HANDLE_TYPE_FABRIC)
        return CUDA_ERROR_NOT_SUPPORTED;
    if (shHandleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_INVALID_VALUE;
    if (take_fault(kFaultImport)) return CUDA_ERROR_INVALID_VALUE;
    const auto raw = reinterpret_cast<uintptr_t>(osHandle);  // the fd, the driver's convention
    if (raw > static_cast<uintptr_t>(INT_MAX)) return CUDA_ERROR_INVALID_VALUE;
    const int fd = static_cast<int>(raw);
    uint64_t token = 0;
    int phys = -1;
    if (!parse_memfd_name(memfd_name_of(fd), token, phys) || phys >= g.physical) return CUDA_ERROR_INVALID_VALUE;
    if (ordinal_of(phys) < 0) return CUDA_ERROR_NOT_SUPPORTED;  // a GPU this process does not see
    struct stat st {};
    if (::fstat(fd, &st) != 0 || st.st_size <= 0 || static_cast<uint64_t>(st.st_size) % kGranularity != 0)
        return CUDA_ERROR_INVALID_VALUE;
    auto p = std::make_shared<Phys>();
    p->fd = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (p->fd < 0) return errno_result(errno);
    p->size = static_cast<size_t>(st.st_size);
    p->phys = phys;
    p->handle_types = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    std::lock_guard lk(g.mu);
    const uint64_t id = g.next_handle++;
    g.handles[id] = std::move(p);
    *handle = id;
    return CUDA_SUCCESS;
}

CUresult MemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                           unsigned long long flags) {
    EMU_TRY(need_init());
    if (!ptr || flags != 0 || size == 0 || size % page_size() != 0 || addr % page_size() != 0 ||
        (alignment & (alignment - 1)) != 0)
        return CUDA_ERROR_INVALID_VALUE;
    const size_t align = std::max(alignment, kGranularity);
    constexpr int kProt = PROT_NONE, kFlags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
    void *p = MAP_FAILED;
    if (addr != 0 && addr % align == 0) {  // the hint, when it is free
        p = ::mmap(reinterpret_cast<void *>(addr), size, kProt, kFlags | MAP_FIXED_NOREPLACE, -1, 0);
        if (p != MAP_FAILED && reinterpret_cast<uintptr_t>(p) != addr) {  // a kernel that took it as a hint
            ::munmap(p, size);
            p = MAP_FAILED;
        }
    }
    if (p == MAP_FAILED) {
        if (size > SIZE_MAX - align) return CUDA_ERROR_OUT_OF_MEMORY;
        void *q = ::mmap(nullptr, size + align, kProt, kFlags, -1, 0);
        if (q == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
        const auto raw = reinterpret_cast<uintptr_t>(q);
        const uintptr_t start = (raw + align - 1) / align * align;
        if (start > raw) ::munmap(q, start - raw);
        if (raw + size + align > start + size)
            ::munmap(reinterpret_cast<void *>(start + size), raw + size + align - (start + size));
        p = reinterpret_cast<void *>(start);
    }
    std::lock_guard lk(g.mu);
    g.reservations[reinterpret_cast<uintptr_t>(p)].size = size;
    *ptr = reinterpret_cast<CUdeviceptr>(p);
    return CUDA_SUCCESS;
}

// State::mu held. The reservation holding [p, p + n).
Reservation *reservation_of(uintptr_t p, size_t n, uintptr_t &base) {
    auto it = g.reservations.upper_bound(p);
    if (it == g.reservations.begin()) return nullptr;
    --it;
    if (p - it->first > it->second.size || n > it->second.size - (p - it->first)) return nullptr;
    base = it->first;
    return &it->second;
}

// State::mu held. The mappings that exactly tile [p, p + n), in order; empty when they do not.
std::vector<std::pair<const uintptr_t, VmmMapping> *> mappings_tiling(Reservation &res, uintptr_t p, size_t n) {
    std::vector<std::pair<const uintptr_t, VmmMapping> *> out;
    for (uintptr_t at = p; at != p + n;) {
        const auto it = res.maps.find(at);
        if (it == res.maps.end() || it->second.size > p + n - at) return {};
        out.push_back(&*it);
        at += it->second.size;
    }
    return out;
}

// State::mu held. Drops a mapping's device range (after operations touching it finish).
void revoke_access(VmmMapping &m) {
    if (!m.access) return;
    g.ranges.erase(m.access->base);
    retire(*m.access);
    m.access.reset();
}

CUresult MemAddressFree(CUdeviceptr ptr, size_t size) {
    EMU_TRY(need_init());
    std::lock_guard lk(g.mu);
    const auto it = g.reservations.find(ptr);
    if (it == g.reservations.end() || it->second.size != size) return CUDA_ERROR_INVALID_VALUE;
    // Still-mapped ranges are unmapped with the reservation (the driver leaves this unspecified).
    for (auto &[b, m] : it->second.maps) revoke_access(m);
    ::munmap(reinterpret_cast<void *>(ptr), size);
    g.reservations.erase(it);
    return CUDA_SUCCESS;
}

CUresult MemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                unsigned long long flags) {
    EMU_TRY(need_init());
    // The driver documents that offset must currently be zero.
    if (flags != 0 || offset != 0 || size == 0 || size % kGranularity != 0 || ptr % kGranularity != 0)
        return CUDA_ERROR_INVALID_VALUE;
    std::lock_guard lk(g.mu);
    const auto h = g.handles.find(handle);
    if (h == g.handles.end() || size > h->second->size) return CUDA_ERROR_INVALID_VALUE;
    uintptr_t base;
    Reservation *res = reservation_of(ptr, size, base);
    if (!res) return CUDA_ERROR_INVALID_VALUE;
    auto next = res->maps.lower_bound(ptr);  // only unmapped parts of a reservation can be mapped
    if (next != res->maps.end() && next->first < ptr + size) return CUDA_ERROR_INVALID_VALUE;
    if (next != res->maps.begin() && std::prev(next)->first + std::prev(next)->second.size > ptr)
        return CUDA_ERROR_INVALID_VALUE;
    void *p = ::mmap(reinterpret_cast<void *>(ptr), size, PROT_NONE, MAP_SHARED | MAP_FIXED, h->second->fd, 0);
    if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    res->maps[ptr] = VmmMapping{size, h->second, PROT_NONE, nullptr};
    return CUDA_SUCCESS;
}

CUresult MemUnmap(CUdeviceptr ptr, size_t size) {
    EMU_TRY(need_init());
    if (size == 0) return CUDA_ERROR_INVALID_VALUE;
    std::lock_guard lk(g.mu);
    uintptr_t base;
    Reservation *res = reservation_of(ptr, size, base);
    if (!res) return CUDA_ERROR_INVALID_VALUE;
    const auto maps = mappings_tiling(*res, ptr, size);
    if (maps.empty()) return CUDA_ERROR_INVALID_VALUE;
    for (auto *m : maps) revoke_access(m->second);
    // Back to a reservation, PROT_NONE like the rest of it.
    if (::mmap(reinterpret_cast<void *>(ptr), size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
               -1, 0) == MAP_FAILED)
        return CUDA_ERROR_OUT_OF_MEMORY;
    for (auto *m : maps) res->maps.erase(m->first);
    return CUDA_SUCCESS;
}

// All emulated GPUs and the host share the memory, so the mapping gets the widest access any
// descriptor grants.
CUresult MemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
    EMU_TRY(need_init());
    if (!desc || count == 0 || size == 0) return CUDA_ERROR_INVALID_VALUE;
    int prot = PROT_NONE;
    for (size_t i = 0; i < count; ++i) {
        int phys = -1;
        switch (desc[i].location.type) {
        case CU_MEM_LOCATION_TYPE_DEVICE: EMU_TRY(device_of(desc[i].location.id, phys)); break;
        case CU_MEM_LOCATION_TYPE_HOST:
        case CU_MEM_LOCATION_TYPE_HOST_NUMA: return CUDA_ERROR_NOT_SUPPORTED;
        default: return CUDA_ERROR_INVALID_VALUE;
        }
        switch (desc[i].flags) {
        case CU_MEM_ACCESS_FLAGS_PROT_NONE: break;
        case CU_MEM_ACCESS_FLAGS_PROT_READ: prot |= PROT_READ; break;
        case CU_MEM_ACCESS_FLAGS_PROT_READWRITE: prot |= PROT_READ | PROT_WRITE; break;
        default: return CUDA_ERROR_INVALID_VALUE;
        }
    }
    std::lock_guard lk(g.mu);
    uintptr_t base;
    Reservation *res = reservation_of(ptr, size, base);
    if (!res) return CUDA_ERROR_INVALID_VALUE;
    const auto maps = mappings_tiling(*res, ptr, size);
    if (maps.empty()) return CUDA_ERROR_INVALID_VALUE;
    for (auto *entry : maps) {
        VmmMapping &m = entry->second;
        if (m.prot == prot) continue;
        // Narrowing waits for operations touching the memory; widening keeps the device range.
        if ((m.prot & ~prot) != 0) revoke_access(m);
        if (::mprotect(reinterpret_cast<void *>(entry->first), m.size, prot) != 0) return CUDA_ERROR_INVALID_VALUE;
        m.prot = prot;
        if (prot == PROT_NONE) continue;
        if (!m.access) {
            auto r = std::make_shared<Range>();
            r->base = entry->first;
            r->size = m.size;
            r->origin = Origin::Vmm;
            r->phys = m.phys->phys;
            r->handle_types = m.phys->handle_types;
            r->span_base = base;
            r->span_size = res->size;
            g.ranges[r->base] = r;
            m.access = std::move(r);
        }
        m.access->writable = (prot & PROT_WRITE) != 0;
    }
    return CUDA_SUCCESS;
}

// --- streams

CUresult StreamCreate(CUstream *phStream, unsigned int Flags) {
    EMU_TRY(need_init());
    if (!phStream || (Flags & ~static_cast<unsigned>(CU_STREAM_NON_BLOCKING))) return CUDA_ERROR_INVALID_VALUE;
    Context *c;
    EMU_TRY(current(c));
    auto s = make_stream(c, Flags);
    std::lock_guard lk(g.mu);
    g.streams[s.get()] = s;
    *phStream = reinterpret_cast<CUstream>(s.get());
    return CUDA_SUCCESS;
}

// Returns at once; work already queued still runs, then the worker exits.
CUresult StreamDestroy(CUstream hStream) {
    EMU_TRY(need_init());
    std::shared_ptr<Stream> s;
    {
        std::lock_guard lk(g.mu);
        const auto it = g.streams.find(reinterpret_cast<Stream *>(hStream));
        if (it == g.streams.end()) return CUDA_ERROR_INVALID_HANDLE;
        s = std::move(it->second);
        g.streams.erase(it);
        std::erase_if(g.draining, [](const auto &w) { return w.expired(); });
        g.draining.push_back(s);  // the context's destruction still stops it
    }
    std::lock_guard lk(s->mu);
    s->closing = true;
    s->work.notify_all();
    return CUDA_SUCCESS;
}

CUresult StreamSynchronize(CUstream hStream) {
    EMU_TRY(need_init());
    std::shared_ptr<Stream> s;
    EMU_TRY(resolve_stream(hStream, s));
    drain(*s);
    return sticky(s->ctx);
}

CUresult StreamQuery(CUstream hStream) {
    EMU_TRY(need_init());
    std::shared_ptr<Stream> s;
    EMU_TRY(resolve_stream(hStream, s));
    EMU_TRY(sticky(s->ctx));
    std::lock_guard lk(s->mu);
    return s->completed == s->enqueued ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

template <typename T>
bool wait_satisfied(unsigned op, T v, T value) {
    using S = std::make_signed_t<T>;
    switch (op) {
    case CU_STREAM_WAIT_VALUE_GEQ: return static_cast<S>(v - value) >= 0;  // wraps around
    case CU_STREAM_WAIT_VALUE_EQ: return v == value;
    case CU_STREAM_WAIT_VALUE_AND: return (v & value) != 0;
    default: return static_cast<T>(~(v | value)) != 0;  // NOR
    }
}

// The address checks both memory operations make at enqueue time.
template <typename T>
CUresult mem_op_target(CUdeviceptr addr, bool write, std::shared_ptr<Range> &r) {
    if (addr % sizeof(T) != 0) return CUDA_ERROR_INVALID_VALUE;  // the word must be naturally aligned
    std::lock_guard lk(g.mu);
    return memory_span(addr, sizeof(T), write, r);
}

template <typename T>
CUresult write_value(CUstream stream, CUdeviceptr addr, T value, unsigned int flags) {
    EMU_TRY(need_init());
    if (flags & ~static_cast<unsigned>(CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER)) return CUDA_ERROR_INVALID_VALUE;
    std::shared_ptr<Stream> s;
    EMU_TRY(resolve_stream(stream, s));
    std::shared_ptr<Range> r;
    EMU_TRY(mem_op_target<T>(addr, true, r));
    // The default orders the write after all earlier work of the stream (a release store);
    // NO_MEMORY_BARRIER permits reordering, which a relaxed store stands for.
    const auto order = (flags & CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER) ? std::memory_order_relaxed
                                                                          : std::memory_order_seq_cst;
    return enqueue(*s, [r, addr, value, order](Stream &st) {
        if (!touch(*r, [&] { std::atomic_ref<T>(*reinterpret_cast<T *>(addr)).store(value, order); }))
            device_fault(st, "stream write value", addr);
    });
}

// Blocks the stream until the condition holds, polling with acquire loads; forever, like the GPU,
// unless the stream's context goes or the memory is freed.
template <typename T>
CUresult wait_value(CUstream stream, CUdeviceptr addr, T value, unsigned int flags) {
    EMU_TRY(need_init());
    // FLUSH: writes other agents made before the word changed are visible after the wait; the
    // acquire load on coherent host memory already gives that.
    const unsigned op = flags & ~static_cast<unsigned>(CU_STREAM_WAIT_VALUE_FLUSH);
    if (op > CU_STREAM_WAIT_VALUE_NOR) return CUDA_ERROR_INVALID_VALUE;
    std::shared_ptr<Stream> s;
    EMU_TRY(resolve_stream(stream, s));
    std::shared_ptr<Range> r;
    EMU_TRY(mem_op_target<T>(addr, false, r));
    return enqueue(*s, [r, addr, value, op](Stream &st) {
        r->users.fetch_add(1);
        for (int i = 0;; ++i) {
            if (r->revoked.load()) {
                r->users.fetch_sub(1);
                device_fault(st, "stream wait value", addr);
                return;
            }
            if (st.cancel.load()) break;
            if (wait_satisfied<T>(op, std::atomic_ref<T>(*reinterpret_cast<T *>(addr)).load(std::memory_order_acquire),
                                  value))
                break;
            if (i < 50)
                std::this_thread::yield();
            else
                std::this_thread::sleep_for(30us);
        }
        r->users.fetch_sub(1);
    });
}

CUresult StreamWriteValue32(CUstream stream, CUdeviceptr addr, cuuint32_t value, unsigned int flags) {
    return write_value<cuuint32_t>(stream, addr, value, flags);
}
CUresult StreamWaitValue32(CUstream stream, CUdeviceptr addr, cuuint32_t value, unsigned int flags) {
    return wait_value<cuuint32_t>(stream, addr, value, flags);
}
CUresult StreamWriteValue64(CUstream stream, CUdeviceptr addr, cuuint64_t value, unsigned int flags) {
    return write_value<cuuint64_t>(stream, addr, value, flags);
}
CUresult StreamWaitValue64(CUstream stream, CUdeviceptr addr, cuuint64_t value, unsigned int flags) {
    return wait_value<cuuint64_t>(stream, addr, value, flags);
}

// Host functions must not call CUDA (the driver's rule); that is not enforced here.
CUresult LaunchHostFunc(CUstream hStream, CUhostFn fn, void *userData) {
    EMU_TRY(need_init());
    if (!fn) return CUDA_ERROR_INVALID_VALUE;
    std::shared_ptr<Stream> s;
    EMU_TRY(resolve_stream(hStream, s));
    return enqueue(*s, [fn, userData](Stream &) { fn(userData); });
}

// --- events

CUresult EventCreate(CUevent *phEvent, unsigned int Flags) {
    EMU_TRY(need_init());
    constexpr unsigned kKnown = CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS;
    if (!phEvent || (Flags & ~kKnown)) return CUDA_ERROR_INVALID_VALUE;
    if (Flags & CU_EVENT_INTERPROCESS) return CUDA_ERROR_NOT_SUPPORTED;  // no IPC event handles
    Context *c;
    EMU_TRY(current(c));
    auto e = std::make_unique<Event>();
    e->ctx = c;
    e->flags = Flags;
    std::lock_guard lk(g.mu);
    *phEvent = reinterpret_cast<CUevent>(e.get());
    g.events[e.get()] = std::move(e);
    return CUDA_SUCCESS;
}

// A new record replaces the earlier one.
CUresult EventRecord(CUevent hEvent, CUstream hStream) {
    EMU_TRY(need_init());
    std::shared_ptr<Stream> s;
    EMU_TRY(resolve_stream(hStream, s));
    std::lock_guard lk(g.mu);
    const auto it = g.events.find(reinterpret_cast<Event *>(hEvent));
    if (it == g.events.end() || it->second->ctx != s->ctx) return CUDA_ERROR_INVALID_HANDLE;
    uint64_t seq;
    EMU_TRY(enqueue(*s, [](Stream &) {}, &seq));
    it->second->stream = std::move(s);
    it->second->seq = seq;
    return CUDA_SUCCESS;
}

CUresult event_target(CUevent hEvent, std::shared_ptr<Stream> &s, uint64_t &seq, Context *&ctx) {
    std::lock_guard lk(g.mu);
    const auto it = g.events.find(reinterpret_cast<Event *>(hEvent));
    if (it == g.events.end()) return CUDA_ERROR_INVALID_HANDLE;
    s = it->second->stream;
    seq = it->second->seq;
    ctx = it->second->ctx;
    return CUDA_SUCCESS;
}

CUresult EventQuery(CUevent hEvent) {
    EMU_TRY(need_init());
    std::shared_ptr<Stream> s;
    uint64_t seq;
    Context *c;
    EMU_TRY(event_target(hEvent, s, seq, c));
    EMU_TRY(sticky(c));
    if (!s) return CUDA_SUCCESS;  // never recorded: complete
    std::lock_guard lk(s->mu);
    return s->completed >= seq ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

CUresult EventSynchronize(CUevent hEvent) {
    EMU_TRY(need_init());
    std::shared_ptr<Stream> s;
    uint64_t seq;
    Context *c;
    EMU_TRY(event_target(hEvent, s, seq, c));
    if (s) wait_for(*s, seq);
    return sticky(c);
}

CUresult EventDestroy(CUevent hEvent) {
    EMU_TRY(need_init());
    std::lock_guard lk(g.mu);
    return g.events.erase(reinterpret_cast<Event *>(hEvent)) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

// --- modules and kernels

CUresult ModuleLoadData(CUmodule *module, const void *image) {
    EMU_TRY(need_init());
    if (!module || !image) return CUDA_ERROR_INVALID_VALUE;
    Context *c;
    EMU_TRY(current(c));
    const char *text = static_cast<const char *>(image);
    if (std::strncmp(text, kImageMagic.data(), kImageMagic.size()) != 0) return CUDA_ERROR_INVALID_IMAGE;
    auto m = std::make_unique<Module>();
    m->ctx = c;
    std::string_view rest(text + kImageMagic.size());
    constexpr std::string_view kSeparators = ", \t\n";
    while (!rest.empty()) {
        const size_t start = rest.find_first_not_of(kSeparators);
        if (start == std::string_view::npos) break;
        rest.remove_prefix(start);
        const std::string_view name = rest.substr(0, rest.find_first_of(kSeparators));
        rest.remove_prefix(name.size());
        if (name != "ringd_spin") return CUDA_ERROR_NO_BINARY_FOR_GPU;  // no CPU implementation
        auto f = std::make_unique<Function>();
        f->module = m.get();
        f->kernel = Kernel::Spin;
        f->name = std::string(name);
        m->functions.push_back(std::move(f));
    }
    std::lock_guard lk(g.mu);
    for (auto &f : m->functions) g.functions[f.get()] = m.get();
    *module = reinterpret_cast<CUmodule>(m.get());
    g.modules[m.get()] = std::move(m);
    return CUDA_SUCCESS;
}

CUresult ModuleUnload(CUmodule hmod) {
    EMU_TRY(need_init());
    std::lock_guard lk(g.mu);
    const auto it = g.modules.find(reinterpret_cast<Module *>(hmod));
    if (it == g.modules.end()) return CUDA_ERROR_INVALID_HANDLE;
    for (auto &f : it->second->functions) g.functions.erase(f.get());
    g.modules.erase(it);
    return CUDA_SUCCESS;
}

CUresult ModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name) {
    EMU_TRY(need_init());
    if (!hfunc || !name) return CUDA_ERROR_INVALID_VALUE;
    std::lock_guard lk(g.mu);
    const auto it = g.modules.find(reinterpret_cast<Module *>(hmod));
    if (it == g.modules.end()) return CUDA_ERROR_INVALID_HANDLE;
    for (auto &f : it->second->functions) {
        if (f->name == name) {
            *hfunc = reinterpret_cast<CUfunction>(f.get());
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_NOT_FOUND;
}

CUresult LaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                      unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                      unsigned int sharedMemBytes, CUstream hStream, void **kernelParams, void **extra) {
    EMU_TRY(need_init());
    if (gridDimX == 0 || gridDimX > static_cast<unsigned>(INT_MAX) || gridDimY == 0 || gridDimZ == 0 || gridDimY > 65535 || gridDimZ > 65535 || blockDimX == 0 ||
        blockDimY == 0 || blockDimZ == 0 || blockDimZ > 64 ||
        static_cast<unsigned long long>(blockDimX) * blockDimY * blockDimZ > 1024 || sharedMemBytes > (48u << 10))
        return CUDA_ERROR_INVALID_VALUE;
    if (extra) return CUDA_ERROR_NOT_SUPPORTED;  // parameters packed in `extra`
    std::shared_ptr<Stream> s;
    EMU_TRY(resolve_stream(hStream, s));
    Kernel kernel;
    {
        std::lock_guard lk(g.mu);
        const auto it = g.functions.find(reinterpret_cast<Function *>(f));
        if (it == g.functions.end() || it->second->ctx != s->ctx) return CUDA_ERROR_INVALID_HANDLE;
        kernel = it->first->kernel;
    }
    switch (kernel) {
    case Kernel::Spin: {
        if (!kernelParams || !kernelParams[0]) return CUDA_ERROR_INVALID_VALUE;
        unsigned long long us;
        std::memcpy(&us, kernelParams[0], sizeof us);  // parameters are taken at launch
        return enqueue(*s, [us](Stream &st) { stream_pause(st, std::chrono::microseconds(us)); });
    }
    }
    return CUDA_ERROR_INVALID_HANDLE;
}

CUresult GetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                        CUdriverProcAddressQueryResult *symbolStatus);

}  // namespace api

// ---------------------------------------------------------------------------------------------
// cuGetProcAddress

// Converts C++ exceptions (allocation failures, thread creation) into driver results.
template <auto F>
struct Guarded;
template <typename... A, CUresult (*F)(A...)>
struct Guarded<F> {
    static CUresult call(A... a) noexcept {
        try {
            return F(a...);
        } catch (const std::bad_alloc &) {
            return CUDA_ERROR_OUT_OF_MEMORY;
        } catch (const std::system_error &) {
            return CUDA_ERROR_OPERATING_SYSTEM;
        } catch (...) {
            return CUDA_ERROR_UNKNOWN;
        }
    }
};

enum : unsigned {
    kOlderAbi = 1,   // before `since`, the name had another ABI (the _v1), which this device lacks
    kPerThread = 2,  // the driver has a per-thread-default-stream variant, which this device lacks
};

struct ProcEntry {
    const char *name;  // the base name, as cuGetProcAddress takes it
    void *fn;
    int since;  // the CUDA version of the ABI `fn` implements
    unsigned traits;
};

// `type` is the cuda.h name (the macro resolves to the versioned symbol, e.g. cuMemAlloc_v2), so
// the cast checks each implementation against the signature the header gives it.
#define EMU_PROC(base, type, impl, since, traits) \
    ProcEntry { base, reinterpret_cast<void *>(static_cast<decltype(&::type)>(&Guarded<&api::impl>::call)), since, traits }
#define EMU_PROC1(name, impl, since, traits) EMU_PROC(#name, name, impl, since, traits)

const ProcEntry kProcs[] = {
    EMU_PROC1(cuInit, Init, 2000, 0),
    EMU_PROC1(cuDriverGetVersion, DriverGetVersion, 2020, 0),
    EMU_PROC("cuGetProcAddress", cuGetProcAddress_v2, GetProcAddress, 12000, kOlderAbi),
    EMU_PROC1(cuGetErrorString, GetErrorString, 6000, 0),
    EMU_PROC1(cuGetErrorName, GetErrorName, 6000, 0),
    EMU_PROC1(cuDeviceGetCount, DeviceGetCount, 2000, 0),
    EMU_PROC1(cuDeviceGet, DeviceGet, 2000, 0),
    EMU_PROC1(cuDeviceGetUuid, DeviceGetUuid, 11040, kOlderAbi),
    EMU_PROC1(cuDeviceGetName, DeviceGetName, 2000, 0),
    EMU_PROC1(cuDeviceGetAttribute, DeviceGetAttribute, 2000, 0),
    EMU_PROC1(cuDevicePrimaryCtxRetain, DevicePrimaryCtxRetain, 7000, 0),
    EMU_PROC1(cuDevicePrimaryCtxRelease, DevicePrimaryCtxRelease, 11000, kOlderAbi),
    EMU_PROC1(cuCtxSetCurrent, CtxSetCurrent, 4000, 0),
    EMU_PROC1(cuCtxGetCurrent, CtxGetCurrent, 4000, 0),
    EMU_PROC1(cuCtxGetDevice, CtxGetDevice, 2000, 0),
    EMU_PROC1(cuCtxSynchronize, CtxSynchronize, 2000, 0),
    EMU_PROC1(cuPointerGetAttribute, PointerGetAttribute, 4000, 0),
    EMU_PROC1(cuMemAlloc, MemAlloc, 3020, kOlderAbi),
    EMU_PROC1(cuMemFree, MemFree, 3020, kOlderAbi),
    EMU_PROC1(cuMemGetAddressRange, MemGetAddressRange, 3020, kOlderAbi),
    EMU_PROC1(cuMemsetD8, MemsetD8, 3020, kOlderAbi | kPerThread),
    EMU_PROC1(cuMemcpyHtoD, MemcpyHtoD, 3020, kOlderAbi | kPerThread),
    EMU_PROC1(cuMemcpyDtoH, MemcpyDtoH, 3020, kOlderAbi | kPerThread),
    EMU_PROC1(cuMemcpyHtoDAsync, MemcpyHtoDAsync, 3020, kOlderAbi | kPerThread),
    EMU_PROC1(cuMemcpyDtoHAsync, MemcpyDtoHAsync, 3020, kOlderAbi | kPerThread),
    EMU_PROC1(cuMemHostRegister, MemHostRegister, 6050, kOlderAbi),
    EMU_PROC1(cuMemHostUnregister, MemHostUnregister, 4000, 0),
    EMU_PROC1(cuMemHostGetDevicePointer, MemHostGetDevicePointer, 3020, kOlderAbi),
    EMU_PROC1(cuMemAllocHost, MemAllocHost, 3020, kOlderAbi),
    EMU_PROC1(cuMemFreeHost, MemFreeHost, 2000, 0),
    EMU_PROC1(cuIpcGetMemHandle, IpcGetMemHandle, 4010, 0),
    EMU_PROC1(cuIpcOpenMemHandle, IpcOpenMemHandle, 11000, kOlderAbi),
    EMU_PROC1(cuIpcCloseMemHandle, IpcCloseMemHandle, 4010, 0),
    EMU_PROC1(cuMemGetAllocationGranularity, MemGetAllocationGranularity, 10020, 0),
    EMU_PROC1(cuMemCreate, MemCreate, 10020, 0),
    EMU_PROC1(cuMemRelease, MemRelease, 10020, 0),
    EMU_PROC1(cuMemExportToShareableHandle, MemExportToShareableHandle, 10020, 0),
    EMU_PROC1(cuMemImportFromShareableHandle, MemImportFromShareableHandle, 10020, 0),
    EMU_PROC1(cuMemAddressReserve, MemAddressReserve, 10020, 0),
    EMU_PROC1(cuMemAddressFree, MemAddressFree, 10020, 0),
    EMU_PROC1(cuMemMap, MemMap, 10020, 0),
    EMU_PROC1(cuMemUnmap, MemUnmap, 10020, 0),
    EMU_PROC1(cuMemSetAccess, MemSetAccess, 10020, 0),
    EMU_PROC1(cuStreamCreate, StreamCreate, 2000, 0),
    EMU_PROC1(cuStreamDestroy, StreamDestroy, 4000, kOlderAbi),
    EMU_PROC1(cuStreamSynchronize, StreamSynchronize, 2000, kPerThread),
    EMU_PROC1(cuStreamQuery, StreamQuery, 2000, kPerThread),
    EMU_PROC1(cuStreamWriteValue32, StreamWriteValue32, 11070, kOlderAbi | kPerThread),
    EMU_PROC1(cuStreamWaitValue32, StreamWaitValue32, 11070, kOlderAbi | kPerThread),
    EMU_PROC1(cuStreamWriteValue64, StreamWriteValue64, 11070, kOlderAbi | kPerThread),
    EMU_PROC1(cuStreamWaitValue64, StreamWaitValue64, 11070, kOlderAbi | kPerThread),
    EMU_PROC1(cuLaunchHostFunc, LaunchHostFunc, 10000, kPerThread),
    EMU_PROC1(cuEventCreate, EventCreate, 2000, 0),
    EMU_PROC1(cuEventRecord, EventRecord, 2000, kPerThread),
    EMU_PROC1(cuEventQuery, EventQuery, 2000, 0),
    EMU_PROC1(cuEventSynchronize, EventSynchronize, 2000, 0),
    EMU_PROC1(cuEventDestroy, EventDestroy, 4000, kOlderAbi),
    EMU_PROC1(cuModuleLoadData, ModuleLoadData, 2000, 0),
    EMU_PROC1(cuModuleUnload, ModuleUnload, 2000, 0),
    EMU_PROC1(cuModuleGetFunction, ModuleGetFunction, 2000, 0),
    EMU_PROC1(cuLaunchKernel, LaunchKernel, 4000, kPerThread),
};
#undef EMU_PROC1
#undef EMU_PROC

CUresult api::GetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                             CUdriverProcAddressQueryResult *symbolStatus) {
    auto status = [&](CUdriverProcAddressQueryResult s) {
        if (symbolStatus) *symbolStatus = s;
    };
    if (!symbol || !pfn) return CUDA_ERROR_INVALID_VALUE;
    *pfn = nullptr;
    constexpr cuuint64_t kKnownFlags = CU_GET_PROC_ADDRESS_LEGACY_STREAM | CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
    if (flags & ~kKnownFlags) return CUDA_ERROR_INVALID_VALUE;
    const ProcEntry *e = nullptr;
    for (const auto &p : kProcs)
        if (std::strcmp(p.name, symbol) == 0) e = &p;
    if (!e) {
        status(CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
        return CUDA_ERROR_NOT_FOUND;
    }
    if (cudaVersion < e->since) {
        status(CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
        return (e->traits & kOlderAbi) ? CUDA_ERROR_NOT_SUPPORTED : CUDA_ERROR_NOT_FOUND;
    }
    if ((flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) && !(flags & CU_GET_PROC_ADDRESS_LEGACY_STREAM) &&
        (e->traits & kPerThread)) {
        status(CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    *pfn = e->fn;
    status(CU_GET_PROC_ADDRESS_SUCCESS);
    return CUDA_SUCCESS;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Exported entry points: what a loader finds with dlsym. Everything else comes through
// cuGetProcAddress.

EMU_EXPORT CUresult cuDriverGetVersion(int *driverVersion) { return api::DriverGetVersion(driverVersion); }

EMU_EXPORT CUresult cuInit(unsigned int Flags) { return Guarded<&api::Init>::call(Flags); }

EMU_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                                        CUdriverProcAddressQueryResult *symbolStatus) {
    return Guarded<&api::GetProcAddress>::call(symbol, pfn, cudaVersion, flags, symbolStatus);
}

// The CUDA 11.3 entry point, without the status (cuda.h maps the name to the _v2).
#undef cuGetProcAddress
EMU_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
    return Guarded<&api::GetProcAddress>::call(symbol, pfn, cudaVersion, flags, nullptr);
}

// Every operation enqueued on `stream` after this call first sleeps `us` microseconds when the
// stream's worker reaches it (0: no delay). Stream 0 is the current context's legacy stream.
EMU_EXPORT void ringd_emu_stream_delay(CUstream stream, unsigned us) {
    try {
        std::shared_ptr<Stream> s;
        const CUresult r = g.initialized.load() ? resolve_stream(stream, s) : CUDA_ERROR_NOT_INITIALIZED;
        if (r != CUDA_SUCCESS) {
            const ErrorText *e = error_text(r);
            std::fprintf(stderr, "%s: ringd_emu_stream_delay ignored: %s\n", kBanner, e ? e->name : "error");
            return;
        }
        std::lock_guard lk(s->mu);
        s->delay_us = us;
    } catch (...) {
        std::fprintf(stderr, "%s: ringd_emu_stream_delay ignored: out of memory\n", kBanner);
    }
}

// The next `count` calls of `kind` fail: "alloc" (cuMemAlloc, cuMemCreate: OUT_OF_MEMORY),
// "ipc_open" (cuIpcOpenMemHandle: MAP_FAILED), "import" (cuMemImportFromShareableHandle:
// INVALID_VALUE), "host_register" (cuMemHostRegister: OUT_OF_MEMORY). count <= 0 clears.
EMU_EXPORT void ringd_emu_inject_fault(const char *kind, int count) {
    for (int k = 0; k < kFaultKinds; ++k) {
        if (kind && std::strcmp(kind, kFaultNames[k]) == 0) {
            g_faults[static_cast<size_t>(k)].store(std::max(count, 0));
            return;
        }
    }
    std::fprintf(stderr, "%s: unknown fault kind '%s' ignored\n", kBanner, kind ? kind : "(null)");
}
