#include "daemon/topology/topology.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <linux/mempolicy.h>
#include <net/if.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

namespace ringd::topology {

namespace fs = std::filesystem;

namespace {

std::string read_line(const fs::path &p) {
    std::ifstream in(p);
    std::string s;
    if (in) std::getline(in, s);
    while (!s.empty() && (s.back() == '\n' || s.back() == ' ' || s.back() == '\r')) s.pop_back();
    return s;
}

// "0000:3b:00.0"
bool is_bus_id(const std::string &s) {
    if (s.size() != 12 || s[4] != ':' || s[7] != ':' || s[10] != '.') return false;
    for (size_t i : {0, 1, 2, 3, 5, 6, 8, 9})
        if (!std::isxdigit(static_cast<unsigned char>(s[i]))) return false;
    return s[11] >= '0' && s[11] <= '7';
}

int parse_index(const std::string &s) {
    if (s.empty()) return -1;
    char *end = nullptr;
    errno = 0;
    const long v = std::strtol(s.c_str(), &end, 10);
    if (errno || *end || v < 0 || v > 4095) return -1;
    return static_cast<int>(v);
}

// The PCI place of the device a class entry's `device` link leads to: the PCI components of its
// real path (a virtio or other child device counts as its PCI parent), the node of the last one.
bool pci_place(const fs::path &device_link, PciPlace &out) {
    std::error_code ec;
    const fs::path real = fs::canonical(device_link, ec);
    if (ec) return false;
    PciPlace p;
    fs::path at;
    fs::path last_pci;
    for (const auto &part : real) {
        at /= part;
        const std::string s = part.string();
        if (s.rfind("pci", 0) == 0 && s.size() > 3 && s.find(':') != std::string::npos) {
            p.root = s;
            p.path.clear();
        } else if (!p.root.empty() && is_bus_id(s)) {
            p.path.push_back(s);
            last_pci = at;
        }
    }
    if (p.root.empty() || p.path.empty()) return false;
    p.node = parse_index(read_line(last_pci / "numa_node"));
    out = std::move(p);
    return true;
}

}  // namespace

CpuList parse_cpulist(const std::string &text, bool *ok) {
    CpuList out;
    bool good = true;
    std::stringstream ss(text);
    std::string item;
    while (std::getline(ss, item, ',')) {
        item.erase(0, std::min(item.size(), item.find_first_not_of(" \t\n")));
        item.erase(item.find_last_not_of(" \t\n") + 1);
        if (item.empty()) continue;
        const auto dash = item.find('-');
        char *end = nullptr;
        errno = 0;
        const unsigned long lo = std::strtoul(item.c_str(), &end, 10);
        unsigned long hi = lo;
        bool bad = errno != 0 || end == item.c_str();
        if (dash != std::string::npos) {
            bad = bad || end != item.c_str() + dash;
            const char *h = item.c_str() + dash + 1;
            hi = std::strtoul(h, &end, 10);
            bad = bad || end == h;
        }
        bad = bad || *end != '\0' || hi < lo || hi >= 1u << 16;
        if (bad) {
            good = false;
            continue;
        }
        for (unsigned long c = lo; c <= hi; ++c) out.push_back(static_cast<uint32_t>(c));
    }
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
    if (ok) *ok = good;
    return out;
}

std::string format_cpulist(const CpuList &cpus) {
    std::string s;
    for (size_t i = 0; i < cpus.size();) {
        size_t j = i;
        while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
        if (!s.empty()) s += ',';
        s += std::to_string(cpus[i]);
        if (j > i) s += '-' + std::to_string(cpus[j]);
        i = j + 1;
    }
    return s;
}

CpuList intersect(const CpuList &a, const CpuList &b) {
    CpuList out;
    std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(out));
    return out;
}

int Machine::node_of_cpu(uint32_t cpu) const {
    for (const auto &n : nodes)
        if (std::binary_search(n.cpus.begin(), n.cpus.end(), cpu)) return n.id;
    return -1;
}

const Nic *Machine::nic(const std::string &name) const {
    for (const auto &n : nics)
        if (n.name == name) return &n;
    return nullptr;
}

Result<Machine> read_machine(const std::string &root_in, std::vector<std::string> *notes) {
    Machine m;
    m.root = root_in.empty() ? "/" : root_in;
    const fs::path root(m.root);
    std::error_code ec;
    auto note = [&](std::string s) {
        if (notes) notes->push_back(std::move(s));
    };
    // NUMA nodes.
    const fs::path nodes = root / "sys/devices/system/node";
    for (fs::directory_iterator it(nodes, ec), end; !ec && it != end; it.increment(ec)) {
        const std::string name = it->path().filename().string();
        if (name.rfind("node", 0) != 0) continue;
        const int id = parse_index(name.substr(4));
        if (id < 0) continue;
        bool ok = true;
        Node n{id, parse_cpulist(read_line(it->path() / "cpulist"), &ok)};
        if (!ok) note(name + "/cpulist is malformed");
        if (!n.cpus.empty()) m.nodes.push_back(std::move(n));  // (a memory-only node has no CPUs)
    }
    std::sort(m.nodes.begin(), m.nodes.end(), [](const Node &a, const Node &b) { return a.id < b.id; });
    if (m.nodes.empty()) {  // a kernel without NUMA: one node of every online CPU
        Node n{0, parse_cpulist(read_line(root / "sys/devices/system/cpu/online"))};
        if (n.cpus.empty()) return make_error(-ENOENT, "no CPUs found under " + (root / "sys/devices/system").string());
        m.nodes.push_back(std::move(n));
    }
    // NICs on a PCI bus (virtual interfaces have none).
    for (const char *kind : {"net", "infiniband"}) {
        std::vector<Nic> found;
        for (fs::directory_iterator it(root / "sys/class" / kind, ec), end; !ec && it != end; it.increment(ec)) {
            Nic n{it->path().filename().string(), kind, {}};
            std::error_code gone;
            if (!fs::exists(it->path() / "device", gone)) {
                m.virtual_nics.push_back(n.name);
                continue;
            }
            if (!pci_place(it->path() / "device", n.pci)) {
                note(std::string(kind) + " device " + n.name + " is not on a PCI bus");
                continue;
            }
            found.push_back(std::move(n));
        }
        ec.clear();
        std::sort(found.begin(), found.end(), [](const Nic &a, const Nic &b) { return a.name < b.name; });
        for (auto &n : found) m.nics.push_back(std::move(n));
    }
    // NVIDIA GPUs (vendor 0x10de; class 0x0300xx display, 0x0302xx 3D controller), by bus id.
    std::vector<PciPlace> gpus;
    for (fs::directory_iterator it(root / "sys/bus/pci/devices", ec), end; !ec && it != end; it.increment(ec)) {
        if (read_line(it->path() / "vendor") != "0x10de") continue;
        const std::string cls = read_line(it->path() / "class");
        if (cls.rfind("0x0300", 0) != 0 && cls.rfind("0x0302", 0) != 0) continue;
        PciPlace p;
        if (pci_place(it->path(), p)) gpus.push_back(std::move(p));
    }
    std::sort(gpus.begin(), gpus.end(), [](const PciPlace &a, const PciPlace &b) { return a.bus_id() < b.bus_id(); });
    for (size_t i = 0; i < gpus.size(); ++i) m.gpus.push_back(Gpu{static_cast<uint32_t>(i), std::move(gpus[i])});
    return m;
}

const char *distance_name(Distance d) {
    switch (d) {
    case Distance::Switch: return "a PCIe switch shared (PIX/PXB)";
    case Distance::HostBridge: return "the same host bridge (PHB)";
    case Distance::Node: return "the same NUMA node (NODE)";
    case Distance::System: return "across NUMA nodes (SYS)";
    }
    return "?";
}

Distance distance(const PciPlace &a, const PciPlace &b) {
    if (a.root == b.root) {
        // Under one root port (a PCIe switch or bridge below the host bridge): the traffic does
        // not go through the CPU.
        if (a.path.size() > 1 && b.path.size() > 1 && a.path.front() == b.path.front()) return Distance::Switch;
        return Distance::HostBridge;
    }
    if (a.node >= 0 && a.node == b.node) return Distance::Node;
    return Distance::System;
}

namespace {

// A NIC's node, and why it is that one.
int nic_node(const Machine &m, const Nic *nic, const std::string &name, std::string &why) {
    if (nic && nic->pci.node >= 0) {
        why = name + " (" + nic->pci.bus_id() + ") is on node " + std::to_string(nic->pci.node);
        return nic->pci.node;
    }
    const bool virt = std::find(m.virtual_nics.begin(), m.virtual_nics.end(), name) != m.virtual_nics.end();
    const std::string what = nic    ? name + " (" + nic->pci.bus_id() + ") has no NUMA node in sysfs"
                             : virt ? name + " is a virtual interface (no PCI device)"
                                    : name + " is not a NIC in " + (fs::path(m.root) / "sys/class").string();
    if (m.nodes.size() == 1) {
        why = what + "; the machine has one NUMA node, " + std::to_string(m.nodes[0].id);
        return m.nodes[0].id;
    }
    why = what;
    return -1;
}

}  // namespace

Plan plan(const Machine &m, const std::vector<std::string> &rails, const CpuList &allowed, bool pin) {
    Plan p;
    p.pin = pin;
    p.allowed = allowed;
    for (uint32_t r = 0; r < rails.size(); ++r) {
        RailChoice c;
        c.rail = r;
        c.nic = rails[r];
        const Nic *nic = m.nic(rails[r]);
        std::string where;
        c.node = nic_node(m, nic, rails[r], where);
        if (!pin) {
            c.cpus_why = "topology.pin is off: anywhere in the daemon's CPUs (" + format_cpulist(allowed) + ")";
            c.memory_why = "topology.pin is off: where the kernel puts it";
        } else if (c.node < 0) {
            c.cpus_why = where + ": anywhere in the daemon's CPUs (" + format_cpulist(allowed) + ")";
            c.memory_why = where + ": where the kernel puts it";
        } else {
            const auto node = std::find_if(m.nodes.begin(), m.nodes.end(), [&](const Node &n) { return n.id == c.node; });
            const CpuList local = node == m.nodes.end() ? CpuList{} : node->cpus;
            const CpuList both = intersect(local, allowed);
            if (both.empty()) {
                c.cpus = allowed;
                c.cpus_why = where + ", whose CPUs (" + format_cpulist(local) + ") the daemon may not run on: its CPUs (" +
                             format_cpulist(allowed) + ")";
            } else {
                c.cpus = both;
                c.cpus_why = where + (both == local ? ": its CPUs" : ": its CPUs within the daemon's (" + format_cpulist(allowed) + ")");
            }
            c.memory_node = c.node;
            c.memory_why = where;
        }
        p.rails.push_back(std::move(c));
    }
    // Each GPU to its nearest rail; ties to the one with fewer GPUs so far, then the first.
    std::vector<uint32_t> load(rails.size(), 0);
    for (const auto &g : m.gpus) {
        GpuChoice c;
        c.gpu = g.index;
        c.bus_id = g.pci.bus_id();
        c.node = g.pci.node;
        for (uint32_t r = 0; r < rails.size(); ++r) {
            const Nic *nic = m.nic(rails[r]);
            if (!nic) continue;
            const Distance d = distance(g.pci, nic->pci);
            if (c.rail < 0 || d < c.how || (d == c.how && load[r] < load[static_cast<uint32_t>(c.rail)])) {
                c.rail = static_cast<int>(r);
                c.how = d;
            }
        }
        if (c.rail < 0) {
            c.why = "no rail is a PCI device here";
        } else {
            ++load[static_cast<uint32_t>(c.rail)];
            c.why = "rail " + std::to_string(c.rail) + " (" + rails[static_cast<uint32_t>(c.rail)] + "): " + distance_name(c.how);
        }
        p.gpus.push_back(std::move(c));
    }
    return p;
}

CpuList Plan::lane_cpus() const {
    CpuList all;
    for (const auto &r : rails) {
        if (r.cpus.empty()) return {};
        CpuList u;
        std::set_union(all.begin(), all.end(), r.cpus.begin(), r.cpus.end(), std::back_inserter(u));
        all = std::move(u);
    }
    return all;
}

int Plan::lane_memory_node() const {
    int node = -2;
    for (const auto &r : rails) node = node == -2 || node == r.memory_node ? r.memory_node : -1;
    return node < 0 ? -1 : node;
}

int slot_node(const Machine &m, const CpuList &allowed, int current, std::string &why) {
    int node = -2;
    for (uint32_t cpu : allowed) {
        const int n = m.node_of_cpu(cpu);
        node = node == -2 || node == n ? n : -1;
    }
    if (node >= 0) {
        why = "the trainer may run on CPUs " + format_cpulist(allowed) + ", all on node " + std::to_string(node);
        return node;
    }
    if (current >= 0) {
        const int n = m.node_of_cpu(static_cast<uint32_t>(current));
        if (n >= 0) {
            why = "the trainer runs on CPU " + std::to_string(current) + " of node " + std::to_string(n) +
                  " (it may run on CPUs " + format_cpulist(allowed) + ")";
            return n;
        }
    }
    why = "where the trainer runs is not known";
    return -1;
}

CpuList process_cpus(int pid, int *current) {
    if (current) *current = -1;
    if (pid <= 0) return {};
    const std::string dir = "/proc/" + std::to_string(pid);
    CpuList allowed;
    std::ifstream status(dir + "/status");
    for (std::string line; std::getline(status, line);) {
        if (line.rfind("Cpus_allowed_list:", 0) != 0) continue;
        std::string v = line.substr(line.find(':') + 1);
        v.erase(0, std::min(v.size(), v.find_first_not_of(" \t")));
        allowed = parse_cpulist(v);
    }
    if (current) {
        // Field 39 of stat (processor), counted after the command's closing parenthesis.
        const std::string stat = read_line(dir + "/stat");
        const auto close = stat.rfind(')');
        if (close != std::string::npos) {
            std::stringstream ss(stat.substr(close + 2));
            std::string field;
            for (int k = 3; ss >> field; ++k)
                if (k == 39) {
                    *current = parse_index(field);
                    break;
                }
        }
    }
    return allowed;
}

namespace {

CpuList cpus_of(const cpu_set_t &set) {
    CpuList out;
    for (uint32_t c = 0; c < CPU_SETSIZE; ++c)
        if (CPU_ISSET(c, &set)) out.push_back(c);
    return out;
}

}  // namespace

CpuList allowed_cpus() {
    cpu_set_t set;
    CPU_ZERO(&set);
    return ::sched_getaffinity(0, sizeof set, &set) == 0 ? cpus_of(set) : CpuList{};
}

Status pin_thread(std::thread &t, const CpuList &cpus) {
    if (cpus.empty() || !t.joinable()) return Ok{};
    cpu_set_t set;
    CPU_ZERO(&set);
    for (uint32_t c : cpus)
        if (c < CPU_SETSIZE) CPU_SET(c, &set);
    const int rc = ::pthread_setaffinity_np(t.native_handle(), sizeof set, &set);
    if (rc != 0) return make_error(-rc, "pinning a thread to CPUs " + format_cpulist(cpus) + ": " + std::strerror(rc));
    return Ok{};
}

CpuList thread_cpus(std::thread &t) {
    cpu_set_t set;
    CPU_ZERO(&set);
    return t.joinable() && ::pthread_getaffinity_np(t.native_handle(), sizeof set, &set) == 0 ? cpus_of(set) : CpuList{};
}

std::string interface_of(const std::string &address) {
    in6_addr want6{};
    in_addr want4{};
    const bool v4 = ::inet_pton(AF_INET, address.c_str(), &want4) == 1;
    if (!v4 && ::inet_pton(AF_INET6, address.c_str(), &want6) != 1) return "";
    ifaddrs *all = nullptr;
    if (::getifaddrs(&all) != 0) return "";
    std::string name;
    for (ifaddrs *a = all; a && name.empty(); a = a->ifa_next) {
        if (!a->ifa_addr) continue;
        if (v4 && a->ifa_addr->sa_family == AF_INET &&
            reinterpret_cast<sockaddr_in *>(a->ifa_addr)->sin_addr.s_addr == want4.s_addr)
            name = a->ifa_name;
        if (!v4 && a->ifa_addr->sa_family == AF_INET6 &&
            std::memcmp(&reinterpret_cast<sockaddr_in6 *>(a->ifa_addr)->sin6_addr, &want6, sizeof want6) == 0)
            name = a->ifa_name;
    }
    ::freeifaddrs(all);
    return name;
}

bool node_online(int node) {
    if (node < 0) return false;
    std::error_code ec, ec2;
    return fs::exists("/sys/devices/system/node/node" + std::to_string(node), ec) ||
           (node == 0 && !fs::exists("/sys/devices/system/node", ec2));
}

bool prefer_node(void *addr, size_t bytes, int node, std::string &why) {
    if (!node_online(node)) {
        why = "node " + std::to_string(node) + " is not a NUMA node of this machine";
        return false;
    }
    unsigned long mask[1024 / (8 * sizeof(unsigned long))] = {};
    if (static_cast<size_t>(node) >= 8 * sizeof mask) {
        why = "node " + std::to_string(node) + " is out of range";
        return false;
    }
    mask[static_cast<size_t>(node) / (8 * sizeof(unsigned long))] |= 1ul << (static_cast<size_t>(node) % (8 * sizeof(unsigned long)));
    // Whole pages only (a slot's data area is aligned to 4 KiB, the page may be larger); the
    // kernel reads one bit fewer than maxnode says, hence the + 1 (as libnuma passes it).
    const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
    const uintptr_t begin = (reinterpret_cast<uintptr_t>(addr) + page - 1) / page * page;
    const uintptr_t end = (reinterpret_cast<uintptr_t>(addr) + bytes) / page * page;
    if (end <= begin) {
        why = "less than a page to place";
        return false;
    }
    if (::syscall(SYS_mbind, begin, end - begin, MPOL_PREFERRED, mask, 8 * sizeof mask + 1, 0) != 0) {
        why = std::string("mbind: ") + std::strerror(errno);
        return false;
    }
    why = "node " + std::to_string(node) + " preferred";
    return true;
}

Result<NodeMemory> NodeMemory::allocate(size_t bytes, int node) {
    NodeMemory m;
    if (bytes == 0) return m;
    void *p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return make_error(-errno, "mmap of " + std::to_string(bytes) + " bytes: " + std::strerror(errno));
    m.data_ = static_cast<std::byte *>(p);
    m.bytes_ = bytes;
    if (node >= 0)
        m.placed_ = prefer_node(p, bytes, node, m.why_);
    else
        m.why_ = "no node chosen";
    return m;
}

NodeMemory &NodeMemory::operator=(NodeMemory &&o) noexcept {
    if (this != &o) {
        if (data_) ::munmap(data_, bytes_);
        data_ = std::exchange(o.data_, nullptr);
        bytes_ = std::exchange(o.bytes_, 0);
        placed_ = o.placed_;
        why_ = std::move(o.why_);
    }
    return *this;
}

NodeMemory::~NodeMemory() {
    if (data_) ::munmap(data_, bytes_);
}

}  // namespace ringd::topology
