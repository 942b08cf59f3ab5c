// The machine read from a described sysfs tree, and the choices ringd makes on it: each rail's
// CPUs and memory node, each GPU's nearest rail, a trainer's slot node; and their application
// (thread pinning read back from the kernel, a preferred-node policy read back from numa_maps).
#include <catch2/catch.hpp>

#include <sys/mman.h>

#include <cstdlib>
#include <filesystem>
#include <future>
#include <fstream>
#include <sstream>
#include <thread>

#include "daemon/topology/topology.h"
#include "tests/support/sysfs.h"

using namespace ringd;
using namespace ringd::topology;

namespace {

struct TempRoot {
    std::string path;
    TempRoot() {
        char t[] = "/tmp/ringd-sysfs-XXXXXX";
        REQUIRE(::mkdtemp(t) != nullptr);
        path = t;
    }
    ~TempRoot() {
        std::error_code ec;
        std::filesystem::remove_all(path, ec);
    }
};

CpuList cpus(const std::string &s) { return parse_cpulist(s); }

// Issue 48's machine (tests/support/sysfs.h), described in a directory and read back.
struct Described {
    TempRoot root;
    Machine m;
    Described() {
        test::FakeSysfs(root.path).two_node_gpu_machine();
        auto r = read_machine(root.path);
        REQUIRE(r);
        m = std::move(*r);
    }
};

bool contains(const std::string &s, const std::string &part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("cpu lists parse and print as the kernel writes them", "[topology]") {
    bool ok = false;
    CHECK(parse_cpulist("0-7,16-23", &ok) == cpus("16-23,0-7"));
    CHECK(ok);
    CHECK(format_cpulist(parse_cpulist("0-7,16-23")) == "0-7,16-23");
    CHECK(format_cpulist(parse_cpulist("3,1,2,9")) == "1-3,9");
    CHECK(format_cpulist(parse_cpulist("")) == "");
    CHECK(parse_cpulist(" 4\n").size() == 1);
    for (const char *bad : {"a", "1-", "5-3", "1-2-3", "99999999"}) {
        INFO(bad);
        parse_cpulist(bad, &ok);
        CHECK_FALSE(ok);
    }
    CHECK(intersect(cpus("0-7"), cpus("4-11")) == cpus("4-7"));
    CHECK(intersect(cpus("0-7"), cpus("8-15")).empty());
}

TEST_CASE("a described two-node GPU machine is read as it is laid out", "[topology]") {
    Described d;
    const Machine *m = &d.m;
    REQUIRE(m->nodes.size() == 2);
    CHECK(m->nodes[0].cpus == cpus("0-7"));
    CHECK(m->nodes[1].cpus == cpus("8-15"));
    CHECK(m->node_of_cpu(9) == 1);
    CHECK(m->node_of_cpu(99) == -1);
    REQUIRE(m->nics.size() == 4);  // two interfaces, two RDMA devices: the same two NICs
    const Nic *nic0 = m->nic("ens1f0");
    REQUIRE(nic0);
    CHECK(nic0->kind == "net");
    CHECK(nic0->pci.root == "pci0000:00");
    CHECK(nic0->pci.path == std::vector<std::string>{"0000:00:01.0", "0000:01:00.0", "0000:02:01.0", "0000:04:00.0"});
    CHECK(nic0->pci.node == 0);
    REQUIRE(m->nic("mlx5_1"));
    CHECK(m->nic("mlx5_1")->pci.node == 1);
    CHECK(m->nic("lo") == nullptr);
    CHECK(m->virtual_nics == std::vector<std::string>{"lo"});
    REQUIRE(m->gpus.size() == 4);
    const char *bus[] = {"0000:03:00.0", "0000:05:00.0", "0000:81:00.0", "0000:82:00.0"};
    for (uint32_t g = 0; g < 4; ++g) {
        CHECK(m->gpus[g].index == g);
        CHECK(m->gpus[g].pci.bus_id() == bus[g]);
        CHECK(m->gpus[g].pci.node == (g < 2 ? 0 : 1));
    }
    CHECK(distance(m->gpus[0].pci, nic0->pci) == Distance::Switch);
    CHECK(distance(m->gpus[1].pci, nic0->pci) == Distance::HostBridge);
    CHECK(distance(m->gpus[2].pci, m->nic("mlx5_1")->pci) == Distance::HostBridge);
    CHECK(distance(m->gpus[2].pci, nic0->pci) == Distance::System);
}

TEST_CASE("each rail's threads and memory go to its NIC's node; each GPU to its nearest rail", "[topology]") {
    Described d;
    const Machine *m = &d.m;
    for (const std::vector<std::string> &rails : {std::vector<std::string>{"mlx5_0", "mlx5_1"}, {"ens1f0", "ens2f0"}}) {
        INFO(rails[0]);
        const Plan p = plan(*m, rails, cpus("0-15"), true);
        REQUIRE(p.rails.size() == 2);
        CHECK(p.rails[0].cpus == cpus("0-7"));
        CHECK(p.rails[1].cpus == cpus("8-15"));
        CHECK(p.rails[0].memory_node == 0);
        CHECK(p.rails[1].memory_node == 1);
        CHECK(contains(p.rails[1].cpus_why, rails[1] + " (0000:83:00.0) is on node 1"));
        REQUIRE(p.gpus.size() == 4);
        CHECK(p.gpus[0].rail == 0);
        CHECK(p.gpus[1].rail == 0);
        CHECK(p.gpus[2].rail == 1);
        CHECK(p.gpus[3].rail == 1);
        CHECK(contains(p.gpus[0].why, "PCIe switch"));
        CHECK(contains(p.gpus[1].why, "host bridge"));
        // A lane serves both rails: the CPUs of both nodes, its staging on neither in particular.
        CHECK(p.lane_cpus() == cpus("0-15"));
        CHECK(p.lane_memory_node() == -1);
        const Plan one = plan(*m, {rails[1]}, cpus("0-15"), true);
        CHECK(one.lane_cpus() == cpus("8-15"));
        CHECK(one.lane_memory_node() == 1);
    }
    SECTION("the unit's CPUAffinity= bounds every choice") {
        const Plan p = plan(*m, {"mlx5_0", "mlx5_1"}, cpus("1"), true);
        CHECK(p.rails[0].cpus == cpus("1"));
        CHECK(p.rails[1].cpus == cpus("1"));
        CHECK(contains(p.rails[1].cpus_why, "may not run on"));
        CHECK(p.rails[1].memory_node == 1);
        const Plan q = plan(*m, {"mlx5_0", "mlx5_1"}, cpus("4-11"), true);
        CHECK(q.rails[0].cpus == cpus("4-7"));
        CHECK(q.rails[1].cpus == cpus("8-11"));
    }
    SECTION("pin off places nothing, and says so") {
        const Plan p = plan(*m, {"mlx5_0"}, cpus("0-15"), false);
        CHECK(p.rails[0].cpus.empty());
        CHECK(p.rails[0].memory_node == -1);
        CHECK(contains(p.rails[0].cpus_why, "topology.pin is off"));
    }
    SECTION("a virtual or unknown interface has no node on a machine of two") {
        const Plan p = plan(*m, {"lo", "eth9"}, cpus("0-15"), true);
        CHECK(p.rails[0].node == -1);
        CHECK(p.rails[0].cpus.empty());
        CHECK(p.rails[0].memory_node == -1);
        CHECK(contains(p.rails[0].cpus_why, "lo is a virtual interface"));
        CHECK(contains(p.rails[1].cpus_why, "eth9 is not a NIC in"));
        for (const auto &g : p.gpus) CHECK(g.rail == -1);
    }
    SECTION("GPUs at the same distance from two rails are shared out") {
        const Plan p = plan(*m, {"mlx5_1", "ens2f0"}, cpus("0-15"), true);  // one NIC twice: every GPU ties
        CHECK(p.gpus[2].rail == 0);
        CHECK(p.gpus[3].rail == 1);
    }
}

TEST_CASE("a trainer's slot goes on the node it runs on", "[topology]") {
    Described d;
    const Machine *m = &d.m;
    std::string why;
    CHECK(slot_node(*m, cpus("8-15"), -1, why) == 1);
    CHECK(contains(why, "all on node 1"));
    CHECK(slot_node(*m, cpus("0-15"), 9, why) == 1);
    CHECK(contains(why, "runs on CPU 9 of node 1"));
    CHECK(slot_node(*m, cpus("0-15"), -1, why) == -1);
    CHECK(slot_node(*m, {}, -1, why) == -1);
    // This process, from /proc: its allowed CPUs and the CPU it is on.
    int current = -2;
    const CpuList mine = process_cpus(::getpid(), &current);
    CHECK(mine == allowed_cpus());
    CHECK(current >= 0);
    CHECK(process_cpus(0, &current).empty());
    CHECK(current == -1);
}

TEST_CASE("what cannot be read of a machine is left out, not guessed", "[topology]") {
    TempRoot t;
    test::FakeSysfs fs(t.path);
    SECTION("nothing at all") { CHECK_FALSE(read_machine(t.path)); }
    SECTION("no NUMA nodes: one node of the online CPUs") {
        fs.write("sys/devices/system/cpu/online", "0-3");
        auto m = read_machine(t.path);
        REQUIRE(m);
        REQUIRE(m->nodes.size() == 1);
        CHECK(m->nodes[0].cpus == cpus("0-3"));
        // A NIC without a node on a machine of one node: that node.
        fs.nic("net", "eth0", "pci0000:00/0000:00:03.0", -1);
        m = read_machine(t.path);
        REQUIRE(m);
        const Plan p = plan(*m, {"eth0"}, cpus("0-3"), true);
        CHECK(p.rails[0].node == 0);
        CHECK(contains(p.rails[0].cpus_why, "has no NUMA node in sysfs; the machine has one NUMA node"));
    }
    SECTION("malformed files") {
        fs.node(0, "0-3");
        fs.node(1, "garbage");
        fs.nic("net", "eth0", "pci0000:00/0000:00:03.0", 0);
        fs.write("sys/devices/pci0000:00/0000:00:03.0/numa_node", "seven");
        fs.write("sys/class/net/eth1/device", "not a link");  // a device that is not on a PCI bus
        std::vector<std::string> notes;
        auto m = read_machine(t.path, &notes);
        REQUIRE(m);
        CHECK(m->nodes.size() == 1);
        REQUIRE(m->nic("eth0"));
        CHECK(m->nic("eth0")->pci.node == -1);
        CHECK(m->nic("eth1") == nullptr);
        CHECK(notes.size() == 2);  // node1's cpulist, eth1
    }
}

TEST_CASE("pinning and placement are read back from the kernel", "[topology]") {
    const CpuList allowed = allowed_cpus();
    REQUIRE_FALSE(allowed.empty());
    std::promise<void> done;
    std::thread th([f = done.get_future()]() mutable { f.wait(); });  // alive until the checks end
    REQUIRE(pin_thread(th, {allowed.back()}));
    CHECK(thread_cpus(th) == CpuList{allowed.back()});
    REQUIRE(pin_thread(th, {}));  // nothing: left as it is
    CHECK(thread_cpus(th) == CpuList{allowed.back()});
    done.set_value();
    th.join();

    auto mem = NodeMemory::allocate(4 << 20, 0);
    REQUIRE(mem);
    CHECK(mem->placed());
    CHECK(mem->why() == "node 0 preferred");
    std::ifstream maps("/proc/self/numa_maps");
    std::stringstream addr;
    addr << std::hex << reinterpret_cast<uintptr_t>(mem->get());
    bool found = false;
    for (std::string line; std::getline(maps, line);)
        if (line.rfind(addr.str() + " ", 0) == 0) {
            found = true;
            CHECK(contains(line, "prefer:0"));
        }
    CHECK(found);
    // A node this machine does not have: the memory is there, unplaced, and says why.
    int missing = 1;
    while (node_online(missing)) ++missing;
    auto other = NodeMemory::allocate(1 << 20, missing);
    REQUIRE(other);
    CHECK_FALSE(other->placed());
    CHECK(contains(other->why(), "not a NUMA node of this machine"));
    auto none = NodeMemory::allocate(1 << 20, -1);
    REQUIRE(none);
    CHECK_FALSE(none->placed());
    CHECK(interface_of("127.0.0.1") == "lo");
    CHECK(interface_of("192.0.2.77").empty());
    CHECK(interface_of("not an address").empty());
}
