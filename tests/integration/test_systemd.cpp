// The systemd unit: `systemd-analyze verify`, and READY=1 / WATCHDOG=1 from a real ringd read on
// a NOTIFY_SOCKET owned by the test.
#include <catch2/catch.hpp>

#include <sys/ptrace.h>
#include <sys/wait.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <dirent.h>
#include <fstream>
#include <thread>

#include "tests/support/cluster.h"
#include "tests/support/harness.h"
#include "tests/support/skip.h"

using namespace ringd;
using namespace ringd::test;

TEST_CASE("ringd sends READY=1 once listening, then WATCHDOG=1 when the watchdog is on", "[systemd]") {
    DaemonOptions o;
    o.env = {"WATCHDOG_USEC=400000"};  // 400 ms: a keep-alive every 200 ms
    Daemon d(o);
    REQUIRE(d.ready());
    // The socket exists by the time READY=1 arrives.
    struct stat st{};
    REQUIRE(::stat(d.socket().c_str(), &st) == 0);
    CHECK(S_ISSOCK(st.st_mode));
    CHECK((st.st_mode & 0777) == 0660);
    CHECK(d.notify().wait_for("WATCHDOG=1", std::chrono::seconds(3)));
    CHECK(d.notify().wait_for("WATCHDOG=1", std::chrono::seconds(3)));
    const int status = d.stop();
    CHECK(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
}

// The thread of process `pid` named `name` (/proc/PID/task/TID/comm), or -1.
static pid_t thread_named(pid_t pid, const std::string &name) {
    const std::string dir = "/proc/" + std::to_string(pid) + "/task";
    DIR *d = ::opendir(dir.c_str());
    if (!d) return -1;
    pid_t found = -1;
    while (dirent *e = ::readdir(d)) {
        if (e->d_name[0] == '.') continue;
        std::string comm = read_file(dir + "/" + e->d_name + "/comm");
        while (!comm.empty() && comm.back() == '\n') comm.pop_back();
        if (comm == name) found = static_cast<pid_t>(std::stoi(e->d_name));
    }
    ::closedir(d);
    return found;
}

TEST_CASE("a stuck progress thread stops the watchdog's keep-alives, and they come back when it moves", "[systemd]") {
    DaemonOptions o;
    o.env = {"WATCHDOG_USEC=400000"};
    o.op_timeout = "60s";  // the op waits on the stopped thread, not on its deadline
    Daemon d(o);
    REQUIRE(d.ready());
    REQUIRE(d.notify().wait_for("WATCHDOG=1", std::chrono::seconds(3)));
    // Only the local path's progress thread stops (ptrace stops one thread, SIGSTOP would stop
    // them all); then an op big enough for that thread (not reduced inline) waits on it.
    const pid_t tid = thread_named(d.pid(), "ringd-local");
    REQUIRE(tid > 0);
    if (::ptrace(PTRACE_SEIZE, tid, nullptr, nullptr) != 0) {
        if (errno == EPERM) RINGD_SKIP("ptrace is not allowed here (kernel.yama.ptrace_scope, or no CAP_SYS_PTRACE)");
        FAIL("PTRACE_SEIZE: " << std::strerror(errno));
    }
    REQUIRE(::ptrace(PTRACE_INTERRUPT, tid, nullptr, nullptr) == 0);
    int wstatus = 0;
    REQUIRE(::waitpid(tid, &wstatus, __WALL) == tid);
    Client a(d.socket(), "stuck", 0, 2, 8 << 20), b(d.socket(), "stuck", 1, 2, 8 << 20);
    const auto stopped = std::chrono::steady_clock::now();  // before the op: ringd's stall clock starts later
    const uint64_t ta = a.submit(0, 1 << 20, RINGD_F32, RINGD_SUM), tb = b.submit(0, 1 << 20, RINGD_F32, RINGD_SUM);
    // Keep-alives go on while the thread is not yet stuck (kStuckAfter, 15 s), then stop.
    bool stuck_logged = false;
    while (std::chrono::steady_clock::now() - stopped < std::chrono::seconds(25) && !stuck_logged) {
        d.notify().next(std::chrono::milliseconds(200));
        stuck_logged = d.log().find("the local path's progress thread (ringd-local) has had work for") != std::string::npos;
    }
    const double after = std::chrono::duration<double>(std::chrono::steady_clock::now() - stopped).count();
    INFO(d.log());
    REQUIRE(stuck_logged);
    CHECK(after >= 15.0);
    CHECK(after < 17.5);
    CHECK(d.log().find("the systemd watchdog is no longer kept alive") != std::string::npos);
    (void)d.notify().next(std::chrono::milliseconds(300));  // a keep-alive sent just before
    CHECK_FALSE(d.notify().wait_for("WATCHDOG=1", std::chrono::seconds(2)));
    // The status names it too, and lists the op on the local path.
    auto st = fetch_status(d.socket());
    REQUIRE(st);
    CHECK(st->find("ringd-local") != std::string::npos);
    const json pending = json::parse(*st)["pending_ops"];
    REQUIRE(pending.size() == 1);
    CHECK(pending[0]["state"] == "local");
    CHECK(pending[0]["age_s"].get<double>() >= 15.0);
    // Let it go: the op completes and the keep-alives come back.
    REQUIRE(::ptrace(PTRACE_DETACH, tid, nullptr, nullptr) == 0);
    CHECK(ringd_wait(a.get(), ta, 10000) == 0);
    CHECK(ringd_wait(b.get(), tb, 10000) == 0);
    CHECK(d.notify().wait_for("WATCHDOG=1", std::chrono::seconds(3)));
    CHECK(d.log().find("the stuck progress thread moved again") != std::string::npos);
}

TEST_CASE("without WATCHDOG_USEC no keep-alives are sent", "[systemd]") {
    Daemon d;
    REQUIRE(d.ready());
    const auto m = d.notify().next(std::chrono::milliseconds(600));
    CHECK(m.find("WATCHDOG=1") == std::string::npos);
}

TEST_CASE("systemd-analyze verify accepts the unit", "[systemd]") {
    const std::string unit = env_or("RINGD_UNIT", "");
    REQUIRE_FALSE(unit.empty());
    if (::system("command -v systemd-analyze >/dev/null 2>&1") != 0) {
        RINGD_SKIP("systemd-analyze is not installed");
    }
    // Verify a copy whose ExecStart points at the built binary (verify checks that it exists).
    const std::string dir = make_temp_dir();
    std::string text = read_file(unit);
    const std::string bin = env_or("RINGD_BIN", "");
    const auto pos = text.find("ExecStart=");
    const auto end = text.find(" --config", pos);
    REQUIRE(pos != std::string::npos);
    text.replace(pos + 10, end - pos - 10, bin);
    std::ofstream(dir + "/ringd.service") << text;
    const auto [code, out] = run_command("systemd-analyze verify --man=no " + dir + "/ringd.service 2>&1");
    INFO(out);
    // Without a running systemd (containers, CI) verify cannot load units at all: skip then.
    if (out.find("Failed to initialize manager") != std::string::npos ||
        out.find("System has not been booted with systemd") != std::string::npos) {
        RINGD_SKIP("systemd-analyze cannot run here: " << out);
    }
    CHECK(code == 0);
    CHECK(out.find("ringd.service") == std::string::npos);  // no complaint about our unit
}

namespace {

// A line of /proc/<pid>/status ("Uid", "CapEff", ...), without the key.
std::string proc_status(pid_t pid, const std::string &key) {
    std::ifstream in("/proc/" + std::to_string(pid) + "/status");
    for (std::string line; std::getline(in, line);)
        if (line.rfind(key + ":", 0) == 0) return line.substr(key.size() + 1);
    return "";
}

}  // namespace

TEST_CASE("the unit runs ringd as its own user without capabilities; a 2-host ring does so here", "[systemd]") {
    const std::string unit = read_file(env_or("RINGD_UNIT", ""));
    REQUIRE_FALSE(unit.empty());
    CHECK_THAT(unit, Catch::Contains("\nUser=ringd\n") && Catch::Contains("\nGroup=ringd\n") &&
                         Catch::Contains("\nCapabilityBoundingSet=\n") && Catch::Contains("\nAmbientCapabilities=\n") &&
                         Catch::Contains("LimitMEMLOCK=infinity") && Catch::Contains("DevicePolicy=closed"));
    CHECK_THAT(read_file(env_or("RINGD_SOURCE_DIR", ".") + "/systemd/ringd.sysusers"), Catch::Contains("u ringd "));
    if (::geteuid() != 0) RINGD_SKIP("needs root to start ringd as another user");
    // As the unit starts it: an unprivileged uid (nobody here), no supplementary groups, no
    // capabilities; the ring forms (authenticated) and runs exact ops on both paths and transports.
    const std::string transport = GENERATE(std::string(), std::string(kIbverbsYaml));
    INFO(transport);
    ClusterOptions o;
    o.uid = 65534;
    o.gid = 65534;
    // Small enough for the 8 MiB memory-lock limit of a container that cannot raise it (the unit
    // sets LimitMEMLOCK=infinity): 1 MiB slots, one lane of 64 KiB x 4 staging and a 4 MiB work area.
    o.extra_yaml = transport + "tuning: {chunk_bytes: 64KiB, depth: 4, lanes: 1}\n";
    TestCluster c(2, o);
    REQUIRE(c.wait_up());
    for (uint32_t h = 0; h < 2; ++h) {
        INFO("host " << h);
        CHECK_THAT(proc_status(c.d[h]->pid(), "Uid"), Catch::StartsWith("\t65534\t65534"));
        CHECK(proc_status(c.d[h]->pid(), "CapEff") == "\t0000000000000000");
        if (transport.empty()) {
            // tcp.congestion: auto without CAP_NET_ADMIN: cubic only where the kernel allows it to
            // anyone, else reno; never the kernel's default (BBR's pacing on this machine).
            const bool cubic_allowed = (" " + read_file("/proc/sys/net/ipv4/tcp_allowed_congestion_control")).find(" cubic") !=
                                       std::string::npos;
            CHECK_THAT(c.status(h)["transport_detail"].get<std::string>(),
                       Catch::StartsWith(cubic_allowed ? "congestion control cubic," : "congestion control reno (tcp.congestion: auto"));
        }
        CHECK(c.status(h)["ring"]["auth"] == (transport.empty() ? "hmac-sha256; control frames MACed, data not (auth.data: none)"
                                                                : "hmac-sha256; control frames MACed (RDMA data: not)"));
    }
    auto cl = connect_all(c, "unprivileged", 2, 1 << 20);  // the test (root) connects to nobody's socket
    allreduce_checked(cl, DType::F32, ReduceOp::Avg, 1001, 1);   // direct exchange
    allreduce_checked(cl, DType::F32, ReduceOp::Sum, 200001, 2);  // the ring
}

namespace {

// Every thread of `pid`: its name (comm) and the CPUs it may run on (Cpus_allowed_list).
std::vector<std::pair<std::string, std::string>> threads_cpus(pid_t pid) {
    std::vector<std::pair<std::string, std::string>> out;
    const std::string dir = "/proc/" + std::to_string(pid) + "/task";
    for (const auto &e : std::filesystem::directory_iterator(dir)) {
        std::string comm = read_file(e.path().string() + "/comm");
        while (!comm.empty() && comm.back() == '\n') comm.pop_back();
        std::ifstream in(e.path().string() + "/status");
        for (std::string line; std::getline(in, line);)
            if (line.rfind("Cpus_allowed_list:", 0) == 0) out.emplace_back(comm, line.substr(line.find_first_not_of(" \t", 18)));
    }
    return out;
}

// The lines of /proc/PID/numa_maps that contain `part`.
std::vector<std::string> numa_maps(pid_t pid, const std::string &part) {
    std::vector<std::string> out;
    std::ifstream in("/proc/" + std::to_string(pid) + "/numa_maps");
    for (std::string line; std::getline(in, line);)
        if (line.find(part) != std::string::npos) out.push_back(line);
    return out;
}

std::vector<int> this_process_cpus() {
    cpu_set_t set;
    CPU_ZERO(&set);
    std::vector<int> out;
    if (::sched_getaffinity(0, sizeof set, &set) == 0)
        for (int c = 0; c < CPU_SETSIZE; ++c)
            if (CPU_ISSET(c, &set)) out.push_back(c);
    return out;
}

// As the kernel writes CPU lists ("0-3,8").
std::string cpulist(const std::vector<int> &cpus) {
    std::string s;
    for (size_t i = 0; i < cpus.size();) {
        size_t j = i;
        while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
        s += (s.empty() ? "" : ",") + std::to_string(cpus[i]) + (j > i ? "-" + std::to_string(cpus[j]) : "");
        i = j + 1;
    }
    return s;
}

// The NUMA nodes of this machine (one when the kernel has none).
size_t numa_nodes() {
    size_t n = 0;
    std::error_code ec;
    for (std::filesystem::directory_iterator it("/sys/devices/system/node", ec), end; !ec && it != end; it.increment(ec))
        n += it->path().filename().string().rfind("node", 0) == 0 && std::isdigit(static_cast<unsigned char>(it->path().filename().string()[4]));
    return std::max<size_t>(n, 1);
}

// A ring of two hosts whose peer never comes: the ring's lanes (progress threads, staging) exist.
DaemonOptions ring_of_two(int port) {
    DaemonOptions o;
    o.hosts_yaml = "hosts:\n  - {name: node0, address: 127.0.0.1, port: " + std::to_string(port) +
                   "}\n  - {name: node1, address: 127.0.0.2, port: " + std::to_string(port) + "}\n";
    o.extra_yaml = "auth: {insecure: true}\ntuning: {lanes: 2}\n";
    return o;
}

}  // namespace

TEST_CASE("ringd keeps every thread within the unit's CPUAffinity=, pins its ring lanes to their NIC's node and places "
          "memory there",
          "[systemd][topology]") {
    const std::vector<int> mine = this_process_cpus();
    REQUIRE_FALSE(mine.empty());
    SECTION("CPUAffinity= of one CPU: every thread runs there") {
        DaemonOptions o = ring_of_two(7461);
        o.cpus = {mine.back()};
        Daemon d(o);
        REQUIRE(d.ready());
        const auto threads = threads_cpus(d.pid());
        CHECK(threads.size() >= 4);  // main, local path, two ring lanes
        for (const auto &[name, cpus] : threads) {
            INFO(name);
            CHECK(cpus == std::to_string(mine.back()));
        }
        const json t = json::parse(*fetch_status(d.socket()))["topology"];
        CHECK(t["allowed_cpus"] == std::to_string(mine.back()));
        // lo is virtual: on a machine of one node its node's CPUs (here the one allowed), else anywhere.
        CHECK(t["rails"][0]["cpus"] == (numa_nodes() == 1 ? std::to_string(mine.back()) : std::string()));
    }
    SECTION("no restriction: the ring's lanes on the node of this machine's sysfs, staging there") {
        Daemon d(ring_of_two(7462));
        REQUIRE(d.ready());
        const json j = json::parse(*fetch_status(d.socket()));
        const json &t = j["topology"];
        REQUIRE(t["nodes"].size() >= 1);
        // 127.0.0.1 is lo's, a virtual interface: on a machine of one node, that node's CPUs;
        // on one of several, anywhere.
        const bool one_node = t["nodes"].size() == 1;
        CHECK(t["rails"][0]["nic"] == "lo");
        // One node: its CPUs within the test's (all of them the daemon may use); several: anywhere.
        CHECK(t["rails"][0]["cpus"] == (one_node ? cpulist(mine) : std::string()));
        size_t lanes = 0;
        for (const auto &[name, cpus] : threads_cpus(d.pid()))
            if (name.rfind("ringd-ring", 0) == 0) {
                ++lanes;
                CHECK(cpus == cpulist(mine));
            }
        CHECK(lanes == 2);
        REQUIRE(j["ring"]["placement"].size() == 2);
        if (one_node) {
            CHECK(j["ring"]["placement"][0]["staging"] == "node 0 preferred");
            CHECK(numa_maps(d.pid(), "prefer:0").size() >= 2);  // the two lanes' staging
        }
    }
    SECTION("a described machine: the lanes on the NIC's node, a trainer's slot on the trainer's node") {
        if (mine.size() < 2) RINGD_SKIP("a described machine of two nodes needs two CPUs here to pin to");
        if (numa_nodes() > 1) RINGD_SKIP("the described machine's node 1 must be one this machine lacks");
        // node 0 = the last CPU here, holding the NIC that 127.0.0.1's interface (lo) is made out to
        // be; node 1 = the others.
        char root[] = "/tmp/ringd-sysfs-XXXXXX";
        REQUIRE(::mkdtemp(root));
        const std::string r = root;
        auto write = [&](const std::string &rel, const std::string &text) {
            std::filesystem::create_directories(std::filesystem::path(r + "/" + rel).parent_path());
            std::ofstream(r + "/" + rel) << text << "\n";
        };
        std::vector<int> others(mine.begin(), mine.end() - 1);
        write("sys/devices/system/node/node0/cpulist", std::to_string(mine.back()));
        write("sys/devices/system/node/node1/cpulist", cpulist(others));
        write("sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/numa_node", "0");
        std::filesystem::create_directories(r + "/sys/class/net/lo");
        std::filesystem::create_symlink("../../../devices/pci0000:00/0000:00:01.0/0000:01:00.0", r + "/sys/class/net/lo/device");
        DaemonOptions o = ring_of_two(7463);
        o.extra_yaml += "topology: {sysfs_root: " + r + "}\n";
        Daemon d(o);
        REQUIRE(d.ready());
        for (const auto &[name, cpus] : threads_cpus(d.pid()))
            if (name.rfind("ringd-ring", 0) == 0) CHECK(cpus == std::to_string(mine.back()));
        // This process as a trainer that runs on node 0's CPU, then one on node 1's.
        cpu_set_t set, saved;
        REQUIRE(::sched_getaffinity(0, sizeof saved, &saved) == 0);
        CPU_ZERO(&set);
        CPU_SET(mine.back(), &set);
        REQUIRE(::sched_setaffinity(0, sizeof set, &set) == 0);
        auto a = std::make_unique<Client>(d.socket(), "placed", 0, 1, 4 << 20);
        CPU_ZERO(&set);
        CPU_SET(others.front(), &set);
        REQUIRE(::sched_setaffinity(0, sizeof set, &set) == 0);
        auto b = std::make_unique<Client>(d.socket(), "elsewhere", 0, 1, 4 << 20);
        REQUIRE(::sched_setaffinity(0, sizeof saved, &saved) == 0);
        const json j = json::parse(*fetch_status(d.socket()));
        const json &t = j["topology"];
        CHECK(t["rails"][0]["node"] == 0);
        CHECK(t["rails"][0]["cpus"] == std::to_string(mine.back()));
        CHECK(j["ring"]["placement"][0]["staging"] == "node 0 preferred");
        REQUIRE(t["slots"].size() == 2);
        for (const auto &s : t["slots"]) {
            INFO(s.dump());
            if (s["group"] == "placed") {
                CHECK(s["node"] == 0);
                CHECK_THAT(s["why"].get<std::string>(), Catch::Contains("all on node 0") && Catch::EndsWith("node 0 preferred"));
            } else {
                CHECK(s["node"] == 1);  // this machine has no node 1: chosen, not placed
                CHECK_THAT(s["why"].get<std::string>(), Catch::Contains("not placed: node 1 is not a NUMA node of this machine"));
            }
        }
        // The slot's data area (its queues before it stay where the daemon wrote them).
        auto preferring = [&](const std::string &slot) {
            size_t n = 0;
            for (const auto &line : numa_maps(d.pid(), "memfd:" + slot)) n += line.find(" prefer:0 ") != std::string::npos;
            return n;
        };
        CHECK(preferring("ringd-placed-0") == 1);
        CHECK(preferring("ringd-elsewhere-0") == 0);
        CHECK(numa_maps(d.pid(), "memfd:ringd-elsewhere-0").size() == 1);
        // ringctl topology shows each choice with its reason.
        const std::string shown = run_command(env_or("RINGCTL_BIN", "build/client/ringctl") + " --socket " + d.socket() + " topology").output;
        CHECK_THAT(shown, Catch::Contains("rail 0 (lo, node 0)") && Catch::Contains("lo (0000:01:00.0) is on node 0") &&
                              Catch::Contains("ring lane 1: runs on CPUs " + std::to_string(mine.back())) &&
                              Catch::Contains("placed rank 0 (pid " + std::to_string(::getpid()) + "): node 0"));
        a.reset();
        b.reset();
        std::error_code ec;
        std::filesystem::remove_all(r, ec);
    }
}
