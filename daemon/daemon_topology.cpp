// The machine ringd runs on and where its threads and memory go (daemon/topology/topology.h):
// read once at start; `ringctl topology` shows it (status: topology).
#include <spdlog/spdlog.h>

#include <nlohmann/json.hpp>

#include "daemon/daemon.h"

namespace ringd {

void Daemon::setup_topology() {
    std::vector<std::string> notes;
    auto m = topology::read_machine(config_.topology.sysfs_root, &notes);
    for (const auto &n : notes) spdlog::debug("topology: {}", n);
    if (!m) {
        machine_error_ = m.error().message;
        spdlog::warn("topology: {}: ringd's threads and memory go where the kernel puts them", machine_error_);
        return;
    }
    machine_ = std::move(*m);
    // The ring's NICs, rail by rail: the interfaces that hold this host's addresses (TCP), or the
    // RDMA device.
    std::vector<std::string> nics;
    if (config_.transport == "ibverbs") {
        std::string nic = config_.ibverbs.device;
        if (nic == "auto")
            for (const auto &n : machine_->nics)
                if (n.kind == "infiniband") {
                    nic = n.name;
                    break;
                }
        nics.push_back(nic);
    } else {
        const HostEntry &me = config_.hosts[self_index_];
        for (uint32_t r = 0; r < me.rail_count(); ++r) {
            std::string nic = topology::interface_of(me.rail_address(r));
            nics.push_back(nic.empty() ? me.rail_address(r) : nic);  // (no interface holds it: named by the address)
        }
    }
    plan_ = topology::plan(*machine_, nics, topology::allowed_cpus(), config_.topology.pin);
    shared_.topology = &plan_;
    spdlog::info("topology ({}): {} NUMA node(s), {} PCI NIC(s), {} GPU(s); the daemon may run on CPUs {}",
                 machine_->root, machine_->nodes.size(), machine_->nics.size(), machine_->gpus.size(),
                 topology::format_cpulist(plan_.allowed));
    for (const auto &r : plan_.rails)
        spdlog::info("topology: rail {} ({}): progress threads on CPUs {} ({}); staging memory: {}", r.rail, r.nic,
                     r.cpus.empty() ? std::string("anywhere") : topology::format_cpulist(r.cpus), r.cpus_why,
                     r.memory_node >= 0 ? "node " + std::to_string(r.memory_node) : std::string("anywhere"));
}

nlohmann::json Daemon::topology_status() const {
    using json = nlohmann::json;
    json j = {{"sysfs_root", config_.topology.sysfs_root}, {"pin", config_.topology.pin}};
    if (!machine_) {
        j["error"] = machine_error_;
        return j;
    }
    j["allowed_cpus"] = topology::format_cpulist(plan_.allowed);
    json nodes = json::array(), nics = json::array(), gpus = json::array(), rails = json::array(), slots = json::array();
    for (const auto &n : machine_->nodes) nodes.push_back({{"node", n.id}, {"cpus", topology::format_cpulist(n.cpus)}});
    auto path = [](const topology::PciPlace &p) {
        std::string s = p.root;
        for (const auto &b : p.path) s += "/" + b;
        return s;
    };
    for (const auto &n : machine_->nics)
        nics.push_back({{"name", n.name}, {"kind", n.kind}, {"bus_id", n.pci.bus_id()}, {"node", n.pci.node}, {"pci_path", path(n.pci)}});
    for (const auto &g : plan_.gpus)
        gpus.push_back({{"gpu", g.gpu}, {"bus_id", g.bus_id}, {"node", g.node}, {"rail", g.rail}, {"why", g.why}});
    for (const auto &r : plan_.rails)
        rails.push_back({{"rail", r.rail},
                         {"nic", r.nic},
                         {"node", r.node},
                         {"cpus", topology::format_cpulist(r.cpus)},
                         {"cpus_why", r.cpus_why},
                         {"memory_node", r.memory_node},
                         {"memory_why", r.memory_why}});
    if (gateway_)
        for (const auto &s : gateway_->slot_places())
            slots.push_back({{"group", s.group}, {"local_rank", s.local_rank}, {"pid", s.pid}, {"node", s.node}, {"why", s.why}});
    j["nodes"] = nodes;
    j["nics"] = nics;
    j["gpus"] = gpus;
    j["rails"] = rails;
    j["slots"] = slots;
    return j;
}

}  // namespace ringd
