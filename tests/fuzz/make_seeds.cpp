// Writes the fuzzers' seed corpora (tests/fuzz/corpus/<harness>/): the frames and descriptors
// ringd's client library and daemons send, made by the same encoders. Run by hand after a format
// changes: build-fuzz/tests/fuzz/fuzz-make-seeds tests/fuzz/corpus. The config and status seeds
// are real files (config/ringd.yaml, a status document captured from a running ringd).
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "proto/frame.h"
#include "proto/peer.h"
#include "proto/rdma.h"
#include "proto/slot.h"

using namespace ringd;
using namespace ringd::proto;

namespace {

Bytes cat(std::vector<Bytes> frames) {
    Bytes out;
    for (auto &f : frames) out.insert(out.end(), f.begin(), f.end());
    return out;
}

void write(const std::filesystem::path &dir, const std::string &name, const Bytes &b) {
    std::filesystem::create_directories(dir);
    std::ofstream(dir / name, std::ios::binary).write(reinterpret_cast<const char *>(b.data()), static_cast<std::streamsize>(b.size()));
}

}  // namespace

int main(int argc, char **argv) {
    if (argc != 2) {
        std::fprintf(stderr, "usage: fuzz-make-seeds CORPUS_DIR\n");
        return 2;
    }
    const std::filesystem::path root = argv[1];

    CudaRegister reg;
    reg.kind = CudaMemoryKind::LegacyIpc;
    reg.alloc_bytes = 2 << 20;
    reg.offset = 4096;
    reg.bytes = 1 << 20;
    for (size_t i = 0; i < kCudaIpcHandleBytes; ++i) reg.ipc_handle[i] = static_cast<uint8_t>(i * 7);
    CudaRegister vmm = reg;
    vmm.kind = CudaMemoryKind::Vmm;
    vmm.offset = 0;
    vmm.bytes = vmm.alloc_bytes;
    const auto client = root / "client_frames";
    write(client, "hello", encode_hello({"job-42", 1, 4, 64 << 20, ""}));
    write(client, "hello-hosts", encode_hello({"torch-3f2a", 0, 2, 256 << 20, "node0,node2,node3"}));
    write(client, "status", encode_status_request({}));
    write(client, "error", encode_error({-22, "client reported: bad slot"}));
    write(client, "cuda", cat({encode_cuda_register(reg), encode_cuda_register(vmm), encode_cuda_unregister(3)}));
    write(client, "replies", cat({encode_welcome({3, 64, 64, 30000, 0x104000, 0x9000, 0x100000}),
                                  encode_cuda_reply({0, 7, ""}), encode_cuda_reply({-2, 0, "not one of this client's"})}));

    const auto peer = root / "peer_frames";
    PeerHello hello{"cluster-a", "node0", "node1", ConnKind::Control, 0, 4, Nonce{}, ""};
    write(peer, "hello", encode_peer_hello(hello));
    PeerHello domain = hello;
    domain.kind = ConnKind::Data;
    domain.domain = "node0,node2";
    write(peer, "hello-domain", encode_peer_hello(domain));
    write(peer, "handshake", cat({encode_peer_challenge({}), encode_peer_auth(Mac{}), encode_peer_accept(9)}));
    write(peer, "ops", cat({encode_heartbeat({5, 9}), encode_group_join({1, "g", 9, 0}),
                            encode_group_incarnation({1, "g", 9, 5, 0, ""}), encode_op_report({1, "g", 2, 100, 0, 1, 2, 0, "", 0, 5}),
                            encode_op_start({1, "g", 2, 7, 8, 5, 1}), encode_op_fail({1, "g", 2, -22, "mismatch: host node1", 5}),
                            encode_ring_ready({4, true}), encode_ring_start({5, 0}), encode_ring_start({6, 9}), encode_ring_ready({4, true, 8}), encode_ring_abort({3, "host node2: no heartbeat"})}));
    Bytes data = encode_op_data({1, "g", 2, 4, 0, 1, 2, 0, "", 0, 5}, OpDataKind::OneShot, 16);
    data.resize(data.size() + 16, 0x3f);
    write(peer, "op-data", data);
    RdmaLinkInfo li;
    li.qps = 2;
    li.fifo_entries = 128;
    li.mtu = 5;
    li.fifo_addr = 0x7f0011223340;
    li.fifo_rkey = 0xabcd5a;
    li.qpn[0] = 0x101;
    li.qpn[1] = 0x102;
    write(peer, "rdma", cat({encode_rdma_link_info(li), encode_rdma_link_ready()}));
    // The ibverbs bring-up harness: the peer's RdmaLinkInfo frame as the transport reads it.
    const auto rdma = root / "rdma_link";
    write(rdma, "link-info", encode_rdma_link_info(li));
    li.qps = 8;
    for (uint32_t q = 0; q < 8; ++q) li.qpn[q] = 0x200 + q, li.psn[q] = 0xffffff - q;
    write(rdma, "link-info-8qps", encode_rdma_link_info(li));

    // The handshake harness: a role byte (1: ringd listens, 0: ringd dials), then the peer's side.
    const auto hs = root / "handshake";
    Bytes as_dialer{1};
    const Bytes from_dialer = cat({encode_peer_hello({"fuzz", "node1", "node0", ConnKind::Control, 0, 2, Nonce{}, ""}),
                                   encode_peer_auth(Mac{})});
    as_dialer.insert(as_dialer.end(), from_dialer.begin(), from_dialer.end());
    write(hs, "dialer-side", as_dialer);
    Bytes as_listener{0};
    const Bytes from_listener = cat({encode_peer_challenge({}), encode_peer_accept(4)});
    as_listener.insert(as_listener.end(), from_listener.begin(), from_listener.end());
    write(hs, "listener-side", as_listener);

    const auto submit = root / "submit";
    auto desc = [](uint64_t seq, uint64_t count, uint32_t dtype, uint32_t op, uint32_t kind, uint64_t offset) {
        SubmitDesc d{};
        d.seq = seq;
        d.count = count;
        d.dtype = dtype;
        d.op = op;
        d.buffer_kind = kind;
        d.offset = offset;
        if (kind == 1) {
            d.cuda_reg = 3;
            d.cuda_offset = 4096;
        }
        Bytes b(sizeof d + 8 + (kind == 1 ? 1 : 0));  // (an odd size: the harness's ringd has CUDA)
        std::memcpy(b.data(), &d, sizeof d);
        const uint64_t data_bytes = 64 << 20;
        std::memcpy(b.data() + sizeof d, &data_bytes, 8);
        return b;
    };
    write(submit, "f32-avg", desc(1, 1 << 20, 0, 1, 0, 0));
    write(submit, "bf16-sum", desc(7, 4097, 3, 0, 0, 8192));
    write(submit, "i64-max-cuda", desc(9, 300000, 5, 3, 1, 1 << 20));
    return 0;
}
