/* libringd-client: hand gradients to the host's ringd and wait for their allreduce.
 *
 * Usage: ringd_connect() joins `group` as `local_rank` of `local_size` trainers on this host and
 * maps a shared-memory slot of `slot_bytes`; put tensors in the slot (ringd_slot()), then
 * ringd_allreduce() in place, or ringd_submit() several and ringd_wait() for their tickets.
 * Every rank of a group must submit the same sequence of ops (same count, dtype and op).
 *
 * Errors: functions return 0 or a negative errno and never abort or throw; ringd_last_error()
 * says what happened. A ringd_client must not be used from two threads at once; only the fd of
 * ringd_fd() may be polled by one thread while another calls into the client.
 *
 * Several ops in flight, waited for by an event loop: submit them, poll ringd_fd() (readable when
 * a result may have arrived or ringd went away), then ringd_test() each ticket.
 *
 * Deadlines: ringd ends every op it accepted within its group's op timeout (timeouts.op, or the
 * group's ringd_options.op_timeout_ms up to timeouts.op_max; the Welcome says which) of the op's
 * submission, plus about a second. The client allows each op its op timeout + a margin (10 s;
 * the environment variable RINGD_WAIT_MARGIN_MS, read by ringd_connect, sets it in milliseconds,
 * at least 2000) from its submission, however late the wait starts: timeout_ms < 0 waits until
 * then, and no wait lasts past it. An op still without a result by then means ringd broke its
 * contract (stopped, hung): the call that finds it fails with -EPROTO, and so does every later
 * call on that client (reconnect). Every wait has a deadline.
 */
#ifndef RINGD_RINGD_H
#define RINGD_RINGD_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define RINGD_API __attribute__((visibility("default")))
#else
#define RINGD_API
#endif

typedef struct ringd_client ringd_client;
struct CUstream_st; /* CUstream / cudaStream_t: no CUDA header needed */
typedef enum { RINGD_F32, RINGD_F64, RINGD_F16, RINGD_BF16, RINGD_I32, RINGD_I64 } ringd_dtype;
typedef enum { RINGD_SUM, RINGD_AVG, RINGD_MIN, RINGD_MAX } ringd_op;
/* What an op computes (ringd_submit_coll). Blocks are in the group's rank order (ringd_options.rank):
 *   RINGD_ALLREDUCE       every rank's buffer becomes the reduction of every rank's buffer
 *   RINGD_REDUCE_SCATTER  the input has one block per rank; rank r's output (one block) is the
 *                         reduction of every rank's block r
 *   RINGD_ALLGATHER       the input is one block; every rank's output has one block per rank, block
 *                         r being rank r's input
 *   RINGD_BROADCAST       one buffer, in place: every rank's becomes the root rank's
 *   RINGD_REDUCE          one buffer, in place: the root rank's becomes the reduction of every
 *                         rank's; the other ranks' may hold partial results afterwards
 *   RINGD_BARRIER         no data: completes on every rank once every rank of the group submitted it
 *   RINGD_ALL_TO_ALL      the input has one block per rank, the output one block per rank: block j
 *                         of rank i's input becomes block i of rank j's output (`count` elements
 *                         each, or each rank's split sizes: ringd_coll.send_counts) */
typedef enum {
    RINGD_ALLREDUCE,
    RINGD_REDUCE_SCATTER,
    RINGD_ALLGATHER,
    RINGD_BROADCAST,
    RINGD_REDUCE,
    RINGD_BARRIER,
    RINGD_ALL_TO_ALL
} ringd_collective;

/* Returns NULL on failure with the reason in err (if err_len > 0). */
RINGD_API ringd_client *ringd_connect(const char *socket_path, const char *group, int local_rank, int local_size,
                            size_t slot_bytes, char *err, size_t err_len);
/* ringd_connect with options; the struct may grow (struct_size says how much the caller knows). */
typedef struct ringd_options {
    size_t struct_size;       /* sizeof(ringd_options), so the struct can grow */
    const char *socket_path;  /* NULL: $RINGD_SOCKET, else /run/ringd/ringd.sock */
    const char *group;
    int local_rank;
    int local_size;
    size_t slot_bytes;
    const char *hosts;        /* comma-separated host names of the group (names as in hosts:), any
                                 order; NULL or "" = every host of the ring */
    /* NULL, or a client of this process whose slot data area this client uses too: ringd_slot()
       gives the same memory (slot_bytes is not used), which holds one of the host's slots
       (memory.max_slots) for all of them, until the last of them is closed; the caller shares its
       ranges out between the clients. For processes in several groups at once (torch new_group). */
    const struct ringd_client *share_slot_of;
    /* The op timeout of the group (ms): every op of it ends within this of its first submission
       on a host, success or error. 0: ringd's timeouts.op; more than timeouts.op_max is clamped to
       it (ringd says so once in its log). Every rank of a group on a host passes the same one. A
       dead or hung host is found by heartbeats within seconds whatever it is: the timeout is for
       ranks that are alive but late (a checkpoint, an evaluation, a compilation). */
    unsigned int op_timeout_ms;
    /* This trainer's rank in the group and the group's ranks, as the job numbers them (torch's rank
       in its process group): the order of reduce_scatter's and allgather's blocks, agreed by every
       host. ranks 0: not said (the group runs allreduce only). Every trainer of the group says them
       or none does; each rank is one trainer. Needs a ringd of the same release (an older one
       refuses the hello). */
    int rank;
    int ranks;
} ringd_options;
RINGD_API ringd_client *ringd_connect_opts(const ringd_options *opts, char *err, size_t err_len);
/* The slot's data area; *bytes receives its size (if bytes is not NULL). */
RINGD_API void *ringd_slot(ringd_client *c, size_t *bytes);
/* Keeps the slot's data area mapped in this process after c (and every client sharing it) is
   closed, until ringd_slot_unhold(the returned handle): for objects made over the slot that may
   outlive the clients. NULL when c is NULL. The connection is not kept. */
RINGD_API void *ringd_slot_hold(ringd_client *c);
RINGD_API void ringd_slot_unhold(void *hold);
/* In place, in the slot, at byte `offset`; 0 or -errno. On -ETIMEDOUT (timeout_ms passed, the op
 * still runs) the op's ticket is given up: its entry is freed when its result arrives, or it can
 * be waited again with ringd_wait (tickets count from 1, one per submitted op). */
RINGD_API int ringd_allreduce(ringd_client *c, size_t offset, size_t count, ringd_dtype dtype, ringd_op op, int timeout_ms);
/* Queues an op; *ticket identifies it for ringd_wait. -EAGAIN when too many ops are unwaited
 * (wait for the ticket named in ringd_last_error()). */
RINGD_API int ringd_submit(ringd_client *c, size_t offset, size_t count, ringd_dtype dtype, ringd_op op, uint64_t *ticket);
/* Any collective on slot buffers: one description (the struct may grow: struct_size). count is
 * the elements of the buffer (allreduce, in place at in_offset), of the output block
 * (reduce_scatter: the input at in_offset has `ranks` such blocks) or of the input block
 * (allgather: the output at out_offset has `ranks` blocks). The output either lies apart from the
 * input or is in place: reduce_scatter's output is the rank's own block of its input, allgather's
 * input is the rank's own block of its output. broadcast and reduce run in place on `count` elements
 * at in_offset from and to rank `root`; a barrier has no data (count and offsets not used). Every
 * rank of the group submits the same collective, count, dtype, op and root for the same op.
 * -ENOTSUP from a ringd without the collective; -EINVAL for any collective but allreduce on a
 * client that did not say its rank (ringd_options). */
/* Wire formats (docs/wire.md): exact, or compressed for the sums and averages of f32 and bf16 data
 * by allreduce, reduce_scatter and reduce — bf16 (half the bytes), fp16 scaled per block of 256
 * (half), int8 with an f32 scale per block of 256 (about a quarter) — always accumulated in f32,
 * each host's ranks reduced before anything is encoded. Every rank of a group uses the same. */
typedef enum ringd_wire {
    RINGD_WIRE_DEFAULT = 0, /* the client's default (ringd_set_wire), else ringd's (wire.default) */
    RINGD_WIRE_EXACT = 1,
    RINGD_WIRE_BF16 = 2,
    RINGD_WIRE_FP16 = 3,
    RINGD_WIRE_INT8 = 4,
} ringd_wire;
/* This client's wire for ops that name none (ringd_allreduce, ringd_submit, device ops, ringd_coll
 * with RINGD_WIRE_DEFAULT), only where it applies (min, max, other dtypes and collectives stay
 * exact); RINGD_WIRE_DEFAULT: ringd's. 0, -EINVAL, or -ENOTSUP from a ringd without wires. */
RINGD_API int ringd_set_wire(ringd_client *c, ringd_wire wire);
typedef struct ringd_coll {
    size_t struct_size; /* sizeof(ringd_coll) */
    ringd_collective collective;
    ringd_dtype dtype;
    ringd_op op; /* not used by allgather, broadcast, barrier */
    size_t count;
    size_t in_offset;
    size_t out_offset; /* reduce_scatter, allgather only */
    int root;          /* broadcast, reduce: the root rank (0 for the others) */
    /* all_to_all with split sizes (count 0): the elements this rank sends to each rank and receives
       from each (`ranks` entries each; NULL: `count` elements per block both ways). The library
       writes both tables, 2 x ranks uint64, at splits_offset in the slot (8-aligned), which the
       caller leaves as they are until the op completes. The input and output lie apart. */
    const uint64_t *send_counts;
    const uint64_t *recv_counts;
    size_t splits_offset;
    /* How this op's values travel between hosts (docs/wire.md): RINGD_WIRE_DEFAULT takes this
       client's (ringd_set_wire), else ringd's (config wire.default), each only where it applies;
       any other value is this op's own, refused (-EINVAL) where it cannot apply. */
    ringd_wire wire;
    /* Error feedback (compressed wires): nonzero keeps, in ringd, what this host's encodings lost of
       the op's values under feedback_tag and adds it to the next op of that tag (DDP's bucket index,
       FSDP's parameter group: a key that follows the tensor, not its place in the slot). An op of
       another size under a tag starts it over; the residuals go when the group's run ends. */
    int feedback;
    uint64_t feedback_tag;
} ringd_coll;
RINGD_API int ringd_submit_coll(ringd_client *c, const ringd_coll *coll, uint64_t *ticket);
/* This rank cannot run its next op, which the group's other ranks submit (e.g. an all_to_all whose
 * split sizes do not fit its slot: needed_bytes, 0 if not said): ringd fails that op on every rank
 * of the group, naming this one and why, and the group goes on with the op after it. Takes the
 * op's place in this client's sequence like ringd_submit_coll; the ticket's wait returns -E2BIG
 * (-ECANCELED without needed_bytes).
 * -ENOTSUP from a ringd without it (an older release): nothing was taken. */
RINGD_API int ringd_refuse(ringd_client *c, ringd_collective collective, uint64_t needed_bytes, uint64_t *ticket);
/* The collectives this library submits through ringd_submit_coll: bit (1 << RINGD_x) for each
 * (a library without this function: allreduce, reduce_scatter and allgather). What a ringd runs
 * is in its status ("collectives"). */
RINGD_API unsigned int ringd_collectives(void);
/* Adds to the bytes this client copied into and out of its slot for ops (a framework's copies of
 * its tensors in and of results out, which ringd cannot see): ringd's status sums them over its
 * clients ("copies"), so that a job can tell whether its collectives copy at all. */
RINGD_API void ringd_note_copies(ringd_client *c, uint64_t in_bytes, uint64_t out_bytes);
/* 0 when the op succeeded, -ETIMEDOUT when timeout_ms passed (the ticket may be waited again),
 * -EPROTO when ringd owed the result (see Deadlines), another -errno when it failed. Waiting for a
 * ticket that ringd_allreduce gave up on is fine. */
RINGD_API int ringd_wait(ringd_client *c, uint64_t ticket, int timeout_ms);
/* Like ringd_wait with no waiting: 0 when the op succeeded, -EINPROGRESS while it runs (the
 * ticket stays), else what ringd_wait returns (the ticket is done, -EPROTO past the contract). */
RINGD_API int ringd_test(ringd_client *c, uint64_t ticket);
/* A file descriptor that polls readable (POLLIN) when a result may have arrived or the connection
 * broke: then ringd_test the tickets in flight. Owned by c (closed by ringd_close). It stays
 * readable while a result that arrived is not yet claimed by ringd_test/ringd_wait (a look at
 * one ticket may take in others' results), and for good once the connection is dead; a look
 * that finds nothing new clears it. -errno on failure. */
RINGD_API int ringd_fd(ringd_client *c);
/* The last error on this client ("" if none). Valid until the next call on c. */
RINGD_API const char *ringd_last_error(const ringd_client *c);
/* ringd's status document (JSON, what `ringctl status --json` prints) into buf, NUL-terminated
 * when it fits; returns its length (call again with a bigger buf when that is >= len) or -errno
 * with the reason in buf. socket_path NULL: $RINGD_SOCKET, else /run/ringd/ringd.sock. */
RINGD_API long ringd_status(const char *socket_path, char *buf, size_t len, int timeout_ms);
/* Disconnects and frees c (NULL is fine). A client that used device buffers first lets the GPU
 * work queued on its streams before this call run out (it may wait on the client's sync words) and
 * frees what ringd_cuda_alloc gave it. */
RINGD_API void ringd_close(ringd_client *c);

/* Device buffers (CUDA). The driver is loaded on first use: RINGD_CUDA_PROVIDER=hardware (the
 * default, libcuda.so.1) or emulated (ringd's software CUDA device, for tests); without it these
 * return -ENODEV. A client uses one GPU (the current context's, or that of the memory it
 * registers first). Memory is handed to ringd once and every op on it is checked against that:
 *  - ringd_cuda_alloc: device memory ringd can map (a VMM allocation passed to ringd as a file
 *    descriptor; works across PID namespaces); freed by ringd_cuda_free or ringd_close.
 *  - ringd_register_cuda: any cudaMalloc-family buffer (e.g. a PyTorch caching-allocator segment),
 *    passed as the legacy IPC handle of its allocation; *reg names it for ringd_unregister_cuda.
 * An op on a device buffer is staged through the slot, placed by the library beside the ops in
 * flight (a slot op that would overlap it gets -EBUSY; a client that also runs slot ops must have
 * read their results before it submits a device op, whose staging may reuse those bytes). An op
 * larger than a part (by default a quarter of the slot's staging room, 64 KiB to 16 MiB;
 * RINGD_CUDA_PART_BYTES, ringd_set_cuda_part_bytes) goes to ringd as
 * parts of consecutive sequence numbers that stream through a window of at most 16 part-sized
 * ranges of the slot, so it may be any number of times the slot's size; the library hands the later
 * parts over as earlier ones end (its own thread does it while the caller is elsewhere). Ops
 * submitted meanwhile follow them in order. While an op still has parts to hand over, its
 * registration cannot be dropped (ringd_unregister_cuda, ringd_cuda_free: -EBUSY). It keeps stream
 * order:
 * ringd_submit_cuda marks the buffer ready on `stream` (NULL: the legacy default stream) and ringd
 * copies it only after everything queued on the stream before; ringd_stream_wait makes a stream
 * wait until the op's result is back in the buffer. If the op fails or ringd goes away, the wait
 * is released anyway (the buffer then holds no result): no stream hangs. A buffer in no
 * registration: -ENOENT. The result and errors come through ringd_wait/ringd_test as for any op. */
RINGD_API int ringd_cuda_alloc(ringd_client *c, size_t bytes, void **dev_ptr);
RINGD_API int ringd_cuda_free(ringd_client *c, void *dev_ptr);
RINGD_API int ringd_register_cuda(ringd_client *c, const void *dev_ptr, size_t bytes, uint64_t *reg);
RINGD_API int ringd_unregister_cuda(ringd_client *c, uint64_t reg);
RINGD_API int ringd_submit_cuda(ringd_client *c, void *dev_ptr, size_t count, ringd_dtype dtype,
                                ringd_op op, struct CUstream_st *stream, uint64_t *ticket);
RINGD_API int ringd_stream_wait(ringd_client *c, uint64_t ticket, struct CUstream_st *stream);
/* Any collective on device buffers: ringd_coll's description with device pointers (the struct may
 * grow: struct_size). input and output lie in the client's registrations, apart or in place as
 * for slot buffers (reduce_scatter's output its rank's block of the input, allgather's input its
 * rank's block of the output); an all_to_all apart only, of equal blocks (count elements each) or
 * with split sizes (send_counts, recv_counts); allreduce, broadcast and reduce run in place on input (output NULL or
 * input): a broadcast's buffer becomes the root's on every rank (the root's is only read), a
 * reduce's the reduction on the root only (the others' are only read). Staged, cut into parts
 * and stream-ordered as ringd_submit_cuda: a part of a reduce_scatter, allgather or all_to_all is
 * the same elements of every block, and takes (ranks + 1) x its bytes of staging (all_to_all:
 * 2 x ranks x them). An all_to_all with split sizes is one op, never cut: its whole input, its
 * whole output and 16 x ranks bytes of sizes must fit the staging room (else -E2BIG, nothing
 * taken: the caller may ringd_refuse it in its place, so that the group's other ranks fail it at
 * once). ringd_cuda_collectives (and ringd_cuda_all_to_all_splits)
 * says which this library submits; -ENOTSUP from a ringd without them (an older release); -EINVAL
 * on a client that did not say its rank. */
typedef struct ringd_coll_cuda {
    size_t struct_size; /* sizeof(ringd_coll_cuda) */
    ringd_collective collective;
    ringd_dtype dtype;
    ringd_op op; /* not used by allgather and broadcast */
    size_t count;
    void *input;
    void *output;
    /* Since broadcast and reduce of device buffers (a struct_size without it: 0). */
    uint32_t root; /* broadcast, reduce: the root's rank in the group (< ringd_options.ranks) */
    /* Since all_to_all of device buffers with split sizes (a struct_size without them: equal
       blocks only). An all_to_all's elements to send to each rank and to receive from each
       (ringd_options.ranks each, in rank order; count 0), read during the call; both NULL: equal
       blocks of count. A side of no elements needs no registration. */
    const uint64_t *send_counts;
    const uint64_t *recv_counts;
} ringd_coll_cuda;
RINGD_API int ringd_submit_coll_cuda(ringd_client *c, const ringd_coll_cuda *coll, struct CUstream_st *stream,
                                     uint64_t *ticket);
/* The collectives this library submits through ringd_submit_coll_cuda: bit (1 << RINGD_x) for each
 * (a library without this function: allreduce, reduce_scatter and allgather; 0 in a library built
 * without CUDA). What a ringd runs is in its status ("device_collectives"). */
RINGD_API unsigned int ringd_cuda_collectives(void);
/* Nonzero when this library submits an all_to_all of device buffers with split sizes
 * (ringd_coll_cuda's send_counts and recv_counts; 0 in a library built without CUDA). What a ringd
 * runs is in its status ("device_all_to_all_splits"). */
RINGD_API int ringd_cuda_all_to_all_splits(void);
/* The part size of this client's device ops from now on (0: RINGD_CUDA_PART_BYTES, else a quarter
 * of the staging room in whole pages, 64 KiB to 16 MiB; at least 4096). It decides how an op is cut
 * into ringd ops, so every rank of a group must use the same (by default, the same slot size); the
 * slot must hold at least one part: a part that does not fit is refused (-E2BIG) naming both sizes. */
RINGD_API int ringd_set_cuda_part_bytes(ringd_client *c, size_t bytes);
/* Device ops of this client are staged in [offset, offset + bytes) of the slot only (bytes 0: the
 * whole slot, the default), e.g. so that a caller that places its own slot ops keeps them apart.
 * offset is a multiple of 256. */
RINGD_API int ringd_set_cuda_staging(ringd_client *c, size_t offset, size_t bytes);
/* The driver's allocation that holds dev_ptr: its base and size (what ringd_register_cuda registers
 * of any pointer into it) and the driver's buffer id, unique for the process's life: memory freed
 * and allocated again at the same address has another id, so a cache of registrations by id never
 * hands ringd memory that was given back. */
RINGD_API int ringd_cuda_allocation(ringd_client *c, const void *dev_ptr, void **base, size_t *bytes,
                                    uint64_t *buffer_id);
/* Submits and waits: returns when the result is in the buffer (or with the op's error). */
RINGD_API int ringd_allreduce_cuda(ringd_client *c, void *dev_ptr, size_t count, ringd_dtype dtype,
                                   ringd_op op, struct CUstream_st *stream, int timeout_ms);

#ifdef __cplusplus
}
#endif

#endif /* RINGD_RINGD_H */
