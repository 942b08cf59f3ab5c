#include "daemon/transport/ibverbs/verbs_api.h"

namespace ringd::verbs {
namespace {

// Several libibverbs entry points are static inline functions or macros in verbs.h; these give
// each one an address.
int hw_query_port(ibv_context *c, uint8_t port, ibv_port_attr *attr) { return ibv_query_port(c, port, attr); }
int hw_query_gid_ex(ibv_context *c, uint32_t port, uint32_t index, ibv_gid_entry *e) {
    return ibv_query_gid_ex(c, port, index, e, 0);
}
ibv_mr *hw_reg_mr(ibv_pd *pd, void *addr, size_t length, int access) { return ibv_reg_mr(pd, addr, length, access); }
int hw_req_notify_cq(ibv_cq *cq, int solicited_only) { return ibv_req_notify_cq(cq, solicited_only); }
int hw_poll_cq(ibv_cq *cq, int n, ibv_wc *wc) { return ibv_poll_cq(cq, n, wc); }
int hw_post_send(ibv_qp *qp, ibv_send_wr *wr, ibv_send_wr **bad) { return ibv_post_send(qp, wr, bad); }
int hw_post_recv(ibv_qp *qp, ibv_recv_wr *wr, ibv_recv_wr **bad) { return ibv_post_recv(qp, wr, bad); }

const VerbsApi kHardware = {
    "hardware",
    ibv_get_device_list,
    ibv_free_device_list,
    ibv_get_device_name,
    ibv_open_device,
    ibv_close_device,
    hw_query_port,
    ibv_query_gid,
    hw_query_gid_ex,
    ibv_alloc_pd,
    ibv_dealloc_pd,
    hw_reg_mr,
    ibv_dereg_mr,
    ibv_create_comp_channel,
    ibv_destroy_comp_channel,
    ibv_create_cq,
    ibv_destroy_cq,
    hw_req_notify_cq,
    ibv_get_cq_event,
    ibv_ack_cq_events,
    hw_poll_cq,
    ibv_create_qp,
    ibv_modify_qp,
    ibv_destroy_qp,
    hw_post_send,
    hw_post_recv,
};

}  // namespace

const VerbsApi &hardware_verbs() { return kHardware; }

}  // namespace ringd::verbs
