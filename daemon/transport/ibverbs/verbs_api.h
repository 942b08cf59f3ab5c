// VerbsApi: the narrow table of libibverbs functions the ibverbs transport calls, and nothing
// else. `hardware_verbs()` points at rdma-core's libibverbs (the real NICs); `emulated_verbs()`
// (emulated_device.h) at ringd's software RDMA device, which implements the same functions with
// RDMA semantics so that the whole transport runs between processes on machines without a NIC.
//
// Every entry has the signature and the return convention of the libibverbs function it is
// named after (ibv_post_send returns an errno value, ibv_poll_cq the number of completions or a
// negative value, ...); the objects passed around are libibverbs' own structs.
#pragma once

#include <infiniband/verbs.h>

namespace ringd::verbs {

struct VerbsApi {
    const char *provider;  // "hardware" | "emulated"

    ibv_device **(*get_device_list)(int *num_devices);
    void (*free_device_list)(ibv_device **list);
    const char *(*get_device_name)(ibv_device *device);
    ibv_context *(*open_device)(ibv_device *device);
    int (*close_device)(ibv_context *context);
    int (*query_port)(ibv_context *context, uint8_t port_num, ibv_port_attr *port_attr);
    int (*query_gid)(ibv_context *context, uint8_t port_num, int index, ibv_gid *gid);
    // ibv_query_gid_ex without the flags: the GID and its type (RoCE v1/v2, IB) at `index`.
    int (*query_gid_ex)(ibv_context *context, uint32_t port_num, uint32_t index, ibv_gid_entry *entry);

    ibv_pd *(*alloc_pd)(ibv_context *context);
    int (*dealloc_pd)(ibv_pd *pd);
    ibv_mr *(*reg_mr)(ibv_pd *pd, void *addr, size_t length, int access);
    int (*dereg_mr)(ibv_mr *mr);

    ibv_comp_channel *(*create_comp_channel)(ibv_context *context);
    int (*destroy_comp_channel)(ibv_comp_channel *channel);
    ibv_cq *(*create_cq)(ibv_context *context, int cqe, void *cq_context, ibv_comp_channel *channel, int comp_vector);
    int (*destroy_cq)(ibv_cq *cq);
    int (*req_notify_cq)(ibv_cq *cq, int solicited_only);
    int (*get_cq_event)(ibv_comp_channel *channel, ibv_cq **cq, void **cq_context);
    void (*ack_cq_events)(ibv_cq *cq, unsigned int nevents);
    int (*poll_cq)(ibv_cq *cq, int num_entries, ibv_wc *wc);

    ibv_qp *(*create_qp)(ibv_pd *pd, ibv_qp_init_attr *attr);
    int (*modify_qp)(ibv_qp *qp, ibv_qp_attr *attr, int attr_mask);
    int (*destroy_qp)(ibv_qp *qp);
    int (*post_send)(ibv_qp *qp, ibv_send_wr *wr, ibv_send_wr **bad_wr);
    int (*post_recv)(ibv_qp *qp, ibv_recv_wr *wr, ibv_recv_wr **bad_wr);
};

// rdma-core's libibverbs.
const VerbsApi &hardware_verbs();

}  // namespace ringd::verbs
