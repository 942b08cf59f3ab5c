// The host's hardware as ringd sees it, and where ringd puts its threads and memory.
//
// read_machine() reads a sysfs tree: the NUMA nodes and their CPUs
// (sys/devices/system/node/nodeN/cpulist), the NICs (sys/class/net/*, sys/class/infiniband/*
// whose `device` is on a PCI bus: their PCI path from the root complex down and their NUMA node)
// and the GPUs (NVIDIA display and 3D controllers under sys/bus/pci/devices, numbered in PCI bus
// order, as CUDA_DEVICE_ORDER=PCI_BUS_ID numbers them). The root is `topology.sysfs_root` ("/":
// this machine), so that a test can describe any machine in a directory.
//
// plan() makes the choices, each with its reason (`ringctl topology` prints them): for each rail
// (a NIC the ring sends on) the CPUs of its progress threads (its NUMA node's, within the CPUs the
// daemon may run on: the unit's CPUAffinity=) and the node of its registered memory and staging;
// for each GPU the nearest rail, by PCI distance as NCCL ranks it (a PCIe switch shared, the same
// host bridge, the same node, across nodes), ties to the rail with fewer GPUs so far. A trainer's
// slot goes on the node it runs on (slot_node()).
//
// Applying them (pin_thread, NodeMemory) only ever narrows: a thread is pinned within the CPUs the
// process has, and memory is placed with a preferred-node policy (MPOL_PREFERRED: the kernel falls
// back to other nodes rather than fail), on nodes this machine has.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "proto/result.h"

namespace ringd::topology {

using CpuList = std::vector<uint32_t>;  // sorted, distinct

// "0-7,16-23" <-> {0..7, 16..23}. parse_cpulist: nullopt-like empty result plus `ok` false on
// anything malformed.
CpuList parse_cpulist(const std::string &text, bool *ok = nullptr);
std::string format_cpulist(const CpuList &cpus);
CpuList intersect(const CpuList &a, const CpuList &b);

struct Node {
    int id = 0;
    CpuList cpus;
};

// A device on a PCI bus: its root complex ("pci0000:00"), the bus ids from the root port down to
// the device itself ("0000:00:01.0", ..., "0000:03:00.0"), and its NUMA node (-1: not known).
struct PciPlace {
    std::string root;
    std::vector<std::string> path;
    int node = -1;
    const std::string &bus_id() const { return path.back(); }
};

struct Nic {
    std::string name;  // the interface (net) or the RDMA device (infiniband)
    std::string kind;  // "net" or "infiniband"
    PciPlace pci;
};

struct Gpu {
    uint32_t index = 0;  // in PCI bus order
    PciPlace pci;
};

struct Machine {
    std::string root;  // the sysfs tree it was read from
    std::vector<Node> nodes;
    std::vector<Nic> nics;
    std::vector<Gpu> gpus;
    std::vector<std::string> virtual_nics;  // interfaces with no device (lo, veth, bridges)
    int node_of_cpu(uint32_t cpu) const;  // -1: none
    const Nic *nic(const std::string &name) const;
};

// Reads the machine under `root` ("" or "/": this one). Fails only when not even one CPU can be
// found; what cannot be read of a device leaves it out (logged by the caller from `notes`).
Result<Machine> read_machine(const std::string &root, std::vector<std::string> *notes = nullptr);

// How far apart two PCI devices are, nearest first (NCCL: PIX/PXB, PHB, NODE, SYS).
enum class Distance { Switch, HostBridge, Node, System };
const char *distance_name(Distance d);
Distance distance(const PciPlace &a, const PciPlace &b);

struct RailChoice {
    uint32_t rail = 0;
    std::string nic;       // as configured (interface or RDMA device)
    int node = -1;         // the NIC's NUMA node (-1: not known)
    CpuList cpus;          // its progress threads' CPUs (empty: not pinned)
    std::string cpus_why;
    int memory_node = -1;  // its registered memory and staging (-1: left to the kernel)
    std::string memory_why;
};

struct GpuChoice {
    uint32_t gpu = 0;
    std::string bus_id;
    int node = -1;
    int rail = -1;  // the nearest rail (-1: no rail)
    Distance how = Distance::System;
    std::string why;
};

struct Plan {
    bool pin = true;
    CpuList allowed;  // the CPUs the daemon may run on (sched_getaffinity at start)
    std::vector<RailChoice> rails;
    std::vector<GpuChoice> gpus;
    // A ring lane's progress thread serves every rail: the CPUs of all their nodes (empty: a rail
    // that may run anywhere), and its staging the node they share (-1: they do not share one).
    CpuList lane_cpus() const;
    int lane_memory_node() const;
};

// `rails`: the NICs the ring sends on, in rail order (names as in sys/class/net or
// sys/class/infiniband). `pin` false (topology.pin: off): nothing pinned or placed, and says so.
Plan plan(const Machine &m, const std::vector<std::string> &rails, const CpuList &allowed, bool pin);

// The node for a trainer's slot: the node of every CPU it may run on (`allowed`, from
// /proc/PID/status), else of the CPU it runs on now (`current`; -1: not known); -1 when neither
// tells. `why` says which.
int slot_node(const Machine &m, const CpuList &allowed, int current, std::string &why);
// A process's allowed CPUs and the CPU it last ran on, from /proc (empty / -1 when gone).
CpuList process_cpus(int pid, int *current);

// The CPUs this process may run on.
CpuList allowed_cpus();
// Pins `t` to `cpus` (nothing when empty); an error says why not.
Status pin_thread(std::thread &t, const CpuList &cpus);
// The CPUs `t` may run on (empty when it is not running).
CpuList thread_cpus(std::thread &t);
// The interface that holds `address` on this machine ("" when none does).
std::string interface_of(const std::string &address);
// Whether this machine (not a described one) has NUMA node `node`.
bool node_online(int node);

// Anonymous memory, page-aligned, placed on a node before anything touches it.
class NodeMemory {
public:
    NodeMemory() = default;
    // `node` < 0: no policy. A node this machine does not have, or an mbind that fails, leaves the
    // memory where the kernel puts it; `placed()` says which happened.
    static Result<NodeMemory> allocate(size_t bytes, int node);
    NodeMemory(NodeMemory &&o) noexcept { *this = std::move(o); }
    NodeMemory &operator=(NodeMemory &&o) noexcept;
    NodeMemory(const NodeMemory &) = delete;
    NodeMemory &operator=(const NodeMemory &) = delete;
    ~NodeMemory();
    std::byte *get() const { return data_; }
    size_t size() const { return bytes_; }
    bool placed() const { return placed_; }
    const std::string &why() const { return why_; }

private:
    std::byte *data_ = nullptr;
    size_t bytes_ = 0;
    bool placed_ = false;
    std::string why_;
};

// Sets a preferred-node policy on [addr, addr + bytes) (page-aligned; shared memory: for every
// mapping of it). False with `why` when it cannot.
bool prefer_node(void *addr, size_t bytes, int node, std::string &why);

}  // namespace ringd::topology
