#include "daemon/transport/ibverbs/verbs.h"

#include <arpa/inet.h>

#include <cerrno>
#include <cstring>

#include "common/fd_io.h"

namespace ringd::verbs {
namespace {

Error verbs_error(int err, const std::string &what) {
    return make_error(-(err ? err : EIO), what + ": " + errno_string(err ? err : EIO));
}

bool is_ipv4_mapped(const ibv_gid &g) {
    static const uint8_t prefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    return std::memcmp(g.raw, prefix, 12) == 0;
}
bool is_link_local(const ibv_gid &g) { return g.raw[0] == 0xfe && (g.raw[1] & 0xc0) == 0x80; }
bool is_zero(const ibv_gid &g) {
    static const uint8_t zero[16] = {};
    return std::memcmp(g.raw, zero, 16) == 0;
}

const char *gid_type_name(uint32_t t) {
    switch (t) {
    case IBV_GID_TYPE_IB: return "IB";
    case IBV_GID_TYPE_ROCE_V1: return "RoCE v1";
    case IBV_GID_TYPE_ROCE_V2: return "RoCE v2";
    }
    return "?";
}

}  // namespace

std::string gid_string(const ibv_gid &gid) {
    char buf[INET6_ADDRSTRLEN] = {};
    ::inet_ntop(AF_INET6, gid.raw, buf, sizeof buf);
    return buf;
}

Result<DeviceContext> open_device(const VerbsApi &api, const std::string &name, std::string &opened_name) {
    int n = 0;
    ibv_device **list = api.get_device_list(&n);
    if (!list || n == 0) {
        const int err = list ? 0 : errno;
        if (list) api.free_device_list(list);
        return make_error(-ENODEV,
                          std::string("transport ibverbs: no RDMA device found (") + api.provider +
                              " provider: ibv_get_device_list found none" + (err ? ": " + errno_string(err) : "") +
                              "). List devices with `ibv_devices` or `rdma link` (packages ibverbs-utils, iproute2); a "
                              "device needs its kernel driver (e.g. mlx5_ib) and ib_uverbs loaded. Without RDMA "
                              "hardware use `transport: tcp`.");
    }
    ibv_device *dev = nullptr;
    std::string names;
    for (int i = 0; i < n; ++i) {
        const char *dn = api.get_device_name(list[i]);
        names += std::string(names.empty() ? "" : ", ") + (dn ? dn : "?");
        if (!dev && (name == "auto" || (dn && name == dn))) dev = list[i];
    }
    if (!dev) {
        api.free_device_list(list);
        return make_error(-ENODEV, "ibverbs.device: no RDMA device '" + name + "' (found: " + names + ")");
    }
    opened_name = api.get_device_name(dev);
    ibv_context *ctx = api.open_device(dev);
    const int err = errno;
    api.free_device_list(list);
    if (!ctx) return verbs_error(err, "ibv_open_device(" + opened_name + ")");
    return DeviceContext(&api, ctx);
}

Result<PortInfo> query_port(const VerbsApi &api, ibv_context *ctx, uint8_t port, const std::string &gid_index) {
    PortInfo pi;
    pi.port = port;
    if (int rc = api.query_port(ctx, port, &pi.attr); rc != 0)
        return verbs_error(rc, "ibv_query_port(port " + std::to_string(port) + ")");
    if (pi.attr.state != IBV_PORT_ACTIVE)
        return make_error(-ENETDOWN, "ibverbs.port " + std::to_string(port) + " is not ACTIVE (state " +
                                         std::to_string(pi.attr.state) + "): check the cable/link (`ibv_devinfo`)");
    const bool roce = pi.attr.link_layer == IBV_LINK_LAYER_ETHERNET;
    auto entry = [&](uint32_t i, ibv_gid_entry &e) { return api.query_gid_ex(ctx, port, i, &e) == 0 && !is_zero(e.gid); };
    if (gid_index != "auto") {
        const auto i = static_cast<uint32_t>(std::stoul(gid_index));
        ibv_gid_entry e{};
        if (i >= static_cast<uint32_t>(pi.attr.gid_tbl_len) || !entry(i, e))
            return make_error(-EINVAL, "ibverbs.gid_index " + gid_index + ": no such GID on port " + std::to_string(port) +
                                           " (list them with `show_gids` or /sys/class/infiniband/*/ports/*/gids)");
        pi.gid_index = i;
        pi.gid = e.gid;
        pi.gid_text = gid_string(e.gid) + " (" + gid_type_name(e.gid_type) + ")";
        return pi;
    }
    if (!roce) {  // InfiniBand: the port GID at index 0, routed by LID
        ibv_gid_entry e{};
        if (!entry(0, e)) return make_error(-ENOENT, "port " + std::to_string(port) + " has no GID at index 0");
        pi.gid = e.gid;
        pi.gid_text = gid_string(e.gid) + " (IB)";
        return pi;
    }
    // RoCE: rank each GID; the best rank wins, the lowest index among equals.
    int best = -1, best_rank = 0;
    ibv_gid_entry best_e{};
    for (uint32_t i = 0; i < static_cast<uint32_t>(pi.attr.gid_tbl_len); ++i) {
        ibv_gid_entry e{};
        if (!entry(i, e) || is_link_local(e.gid)) continue;
        const bool v2 = e.gid_type == IBV_GID_TYPE_ROCE_V2;
        const bool loop = is_ipv4_mapped(e.gid) && e.gid.raw[12] == 127;
        int rank = v2 ? (is_ipv4_mapped(e.gid) ? 4 : 3) : 1;
        if (loop) rank = v2 ? 2 : 0;  // only where nothing else exists (a test device)
        if (best < 0 || rank > best_rank) {
            best = static_cast<int>(i);
            best_rank = rank;
            best_e = e;
        }
    }
    if (best < 0)
        return make_error(-ENOENT, "port " + std::to_string(port) +
                                       ": no routable GID (only link-local or none); give the interface an IP address "
                                       "or set ibverbs.gid_index");
    pi.gid_index = static_cast<uint32_t>(best);
    pi.gid = best_e.gid;
    pi.gid_text = gid_string(best_e.gid) + " (" + gid_type_name(best_e.gid_type) + ")";
    return pi;
}

Status qp_to_init(const VerbsApi &api, ibv_qp *qp, uint8_t port) {
    ibv_qp_attr a = {};
    a.qp_state = IBV_QPS_INIT;
    a.pkey_index = 0;
    a.port_num = port;
    a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
    if (int rc = api.modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS); rc != 0)
        return verbs_error(rc, "QP " + std::to_string(qp->qp_num) + " RESET -> INIT");
    return Ok{};
}

Status qp_to_rtr(const VerbsApi &api, ibv_qp *qp, const QpPath &p) {
    ibv_qp_attr a = {};
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = p.mtu;
    a.dest_qp_num = p.dest_qpn;
    a.rq_psn = p.rq_psn;
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = p.min_rnr_timer;
    a.ah_attr.dlid = p.dlid;
    a.ah_attr.port_num = p.port;
    a.ah_attr.is_global = p.global ? 1 : 0;
    a.ah_attr.grh.dgid = p.dgid;
    a.ah_attr.grh.sgid_index = p.sgid_index;
    a.ah_attr.grh.hop_limit = 64;
    const int mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                     IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
    if (int rc = api.modify_qp(qp, &a, mask); rc != 0)
        return verbs_error(rc, "QP " + std::to_string(qp->qp_num) + " INIT -> RTR (to QP " + std::to_string(p.dest_qpn) +
                                   " at " + gid_string(p.dgid) + ")");
    return Ok{};
}

Status qp_to_rts(const VerbsApi &api, ibv_qp *qp, const QpPath &p) {
    ibv_qp_attr a = {};
    a.qp_state = IBV_QPS_RTS;
    a.timeout = p.timeout;
    a.retry_cnt = p.retry_cnt;
    a.rnr_retry = p.rnr_retry;
    a.sq_psn = p.sq_psn;
    a.max_rd_atomic = 1;
    const int mask = IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                     IBV_QP_MAX_QP_RD_ATOMIC;
    if (int rc = api.modify_qp(qp, &a, mask); rc != 0)
        return verbs_error(rc, "QP " + std::to_string(qp->qp_num) + " RTR -> RTS");
    return Ok{};
}

}  // namespace ringd::verbs
