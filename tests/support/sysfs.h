// A described machine for the topology tests: a sysfs tree in a temporary directory, laid out as
// the kernel lays out its own (devices under sys/devices/pciDDDD:BB/..., class entries and
// sys/bus/pci/devices with relative links into it), so that ringd reads it as it reads /sys.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace ringd::test {

class FakeSysfs {
public:
    explicit FakeSysfs(const std::string &root) : root_(root) {}
    const std::string &root() const { return root_; }

    void node(int id, const std::string &cpulist) { write("sys/devices/system/node/node" + std::to_string(id) + "/cpulist", cpulist); }
    // A PCI device at `path` ("pci0000:00/0000:00:01.0/.../0000:03:00.0") with its vendor, class
    // and NUMA node files, listed under sys/bus/pci/devices.
    void pci(const std::string &path, const std::string &vendor, const std::string &cls, int numa_node) {
        const std::string dir = "sys/devices/" + path;
        write(dir + "/vendor", vendor);
        write(dir + "/class", cls);
        write(dir + "/numa_node", std::to_string(numa_node));
        const std::string id = path.substr(path.rfind('/') + 1);
        link("sys/bus/pci/devices/" + id, "../../../devices/" + path);
    }
    void gpu(const std::string &path, int numa_node) { pci(path, "0x10de", "0x030200", numa_node); }
    // A NIC: the PCI device and its class entry (net: an interface; infiniband: an RDMA device).
    void nic(const std::string &kind, const std::string &name, const std::string &path, int numa_node) {
        pci(path, "0x15b3", "0x020000", numa_node);
        link("sys/class/" + kind + "/" + name + "/device", "../../../devices/" + path);
    }
    void virtual_nic(const std::string &name) { std::filesystem::create_directories(root_ + "/sys/class/net/" + name); }
    void write(const std::string &rel, const std::string &text) {
        const std::filesystem::path p = root_ + "/" + rel;
        std::filesystem::create_directories(p.parent_path());
        std::ofstream(p) << text << "\n";
    }

    // The machine of issue 48's description: NUMA node 0 with CPUs 0-7, GPUs 0 and 1 and NIC 0
    // (GPU 0 and NIC 0 under one PCIe switch); node 1 with CPUs 8-15, GPUs 2 and 3 and NIC 1. The
    // NICs are both an interface (ens1f0, ens2f0) and an RDMA device (mlx5_0, mlx5_1); lo is virtual.
    void two_node_gpu_machine() {
        node(0, "0-7");
        node(1, "8-15");
        gpu("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0", 0);
        for (const char *kind : {"net", "infiniband"})
            nic(kind, kind == std::string("net") ? "ens1f0" : "mlx5_0", "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:04:00.0", 0);
        gpu("pci0000:00/0000:00:02.0/0000:05:00.0", 0);
        gpu("pci0000:80/0000:80:01.0/0000:81:00.0", 1);
        gpu("pci0000:80/0000:80:02.0/0000:82:00.0", 1);
        for (const char *kind : {"net", "infiniband"})
            nic(kind, kind == std::string("net") ? "ens2f0" : "mlx5_1", "pci0000:80/0000:80:03.0/0000:83:00.0", 1);
        virtual_nic("lo");
    }

private:
    void link(const std::string &rel, const std::string &target) {
        const std::filesystem::path p = root_ + "/" + rel;
        std::filesystem::create_directories(p.parent_path());
        std::error_code ec;
        std::filesystem::remove(p, ec);
        std::filesystem::create_symlink(target, p);
    }
    std::string root_;
};

}  // namespace ringd::test
