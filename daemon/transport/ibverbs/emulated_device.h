// The software RDMA device (`ibverbs.provider: emulated`): the functions of VerbsApi implemented
// in user space with RDMA semantics, for machines without an RDMA NIC — tests and development.
//
// What it is: one device, "ringd_emu0", with one Ethernet (RoCE) port. Its GID table is built
// like a RoCE NIC's from the addresses of the network namespace it is opened in: a link-local
// GID (not routable) and, per IPv4 address, an IPv4-mapped GID, each as RoCE v1 and v2. Every
// opened context runs the "NIC": a TX thread that executes posted work requests and an RX thread
// that executes the requests of remote QPs and their acknowledgements. The wire between two RC
// QPs is a TCP connection per direction to the peer's IPv4 address (from the destination GID)
// and port; the port is the port's LID (on a real RoCE port the LID is 0 and unused), so the
// emulated packets cross the same (namespace) links as any other traffic.
//
// Semantics kept (what the transport and its tests rely on):
// - PDs, MRs with lkey/rkey and access flags; a remote WRITE is checked against the rkey, its
//   PD, REMOTE_WRITE and the region's bounds, and lands in the responder's registered memory
//   without the responder's software (the RX thread is the NIC's DMA engine).
// - RC QPs: RESET → INIT → RTR → RTS with the attribute masks libibverbs requires; posting a
//   send outside RTS or a receive in RESET fails with EINVAL; any error moves the QP to ERROR
//   and flushes its outstanding work requests (IBV_WC_WR_FLUSH_ERR).
// - RDMA WRITE and WRITE_WITH_IMM, in order per QP; WRITE_WITH_IMM consumes one posted receive
//   and completes it with the immediate; signalled and unsignalled sends, inline data (copied at
//   post time), several SGEs.
// - Errors as completions: bad rkey / PD / access / bounds → IBV_WC_REM_ACCESS_ERR; a missing
//   receive → RNR NAKs retried for rnr_retry × the responder's min_rnr_timer, then
//   IBV_WC_RNR_RETRY_EXC_ERR (rnr_retry 7 = forever, as on hardware); a peer that is gone or
//   never answers → IBV_WC_RETRY_EXC_ERR after timeout × (retry_cnt + 1) (at least 2 s here: the
//   emulated NIC's acknowledgements depend on the peer process being scheduled); a bad lkey →
//   IBV_WC_LOC_PROT_ERR.
// - CQs with a capacity (overrun makes poll_cq fail), completion channels (an fd that becomes
//   readable once per armed CQ's next completion; O_NONBLOCK on it is honoured).
// - reg_mr honours RLIMIT_MEMLOCK like the kernel (ENOMEM beyond it, unless CAP_IPC_LOCK).
// Not emulated: SEND/RECV with buffers, READ, atomics, SRQs, UD, address handles.
#pragma once

#include "daemon/transport/ibverbs/verbs_api.h"

namespace ringd::verbs {

const VerbsApi &emulated_verbs();

// The name of the emulated device.
inline constexpr const char *kEmulatedDeviceName = "ringd_emu0";

}  // namespace ringd::verbs
