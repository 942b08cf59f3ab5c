// C++ RAII wrapper over the C ABI of libringd-client. Errors become ringd::Error exceptions here,
// in the caller's code; nothing throws across the C ABI.
#pragma once

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>

#include "ringd/ringd.h"

namespace ringd {

class ClientError : public std::runtime_error {
public:
    ClientError(int code, const std::string &what) : std::runtime_error(what), code_(code) {}
    int code() const { return code_; }  // negative errno

private:
    int code_;
};

class Client {
public:
    // hosts: the group's hosts, comma-separated; "" = every host of the ring. op_timeout_ms: the
    // group's op timeout (ringd_options.op_timeout_ms; 0: ringd's timeouts.op). rank of ranks:
    // this trainer's rank in the group (ringd_options.rank; ranks 0: not said, allreduce only).
    Client(const std::string &socket, const std::string &group, int local_rank, int local_size, size_t slot_bytes,
           const std::string &hosts = "", unsigned op_timeout_ms = 0, int rank = 0, int ranks = 0) {
        char err[512] = "";
        ringd_options o{};
        o.struct_size = sizeof o;
        o.socket_path = socket.c_str();
        o.group = group.c_str();
        o.local_rank = local_rank;
        o.local_size = local_size;
        o.slot_bytes = slot_bytes;
        o.hosts = hosts.c_str();
        o.op_timeout_ms = op_timeout_ms;
        o.rank = rank;
        o.ranks = ranks;
        c_ = ringd_connect_opts(&o, err, sizeof err);
        if (!c_) throw ClientError(-ECONNREFUSED, err);
    }
    Client(Client &&o) noexcept : c_(std::exchange(o.c_, nullptr)) {}
    Client &operator=(Client &&o) noexcept {
        if (this != &o) {
            ringd_close(c_);
            c_ = std::exchange(o.c_, nullptr);
        }
        return *this;
    }
    Client(const Client &) = delete;
    Client &operator=(const Client &) = delete;
    ~Client() { ringd_close(c_); }

    std::span<std::byte> slot() const {
        size_t n = 0;
        void *p = ringd_slot(c_, &n);
        return {static_cast<std::byte *>(p), n};
    }
    // `count` elements of T at byte `offset` of the slot; throws when they do not fit.
    template <typename T>
    std::span<T> slot_as(size_t offset, size_t count) const {
        auto s = slot();
        if (offset > s.size() || count > (s.size() - offset) / sizeof(T)) throw ClientError(-ERANGE, "outside the slot");
        return {reinterpret_cast<T *>(s.data() + offset), count};
    }

    void allreduce(size_t offset, size_t count, ringd_dtype dtype, ringd_op op, int timeout_ms = -1) {
        check(ringd_allreduce(c_, offset, count, dtype, op, timeout_ms));
    }
    // Any collective (ringd_submit_coll); returns its ticket. broadcast and reduce: `root`, in place
    // at in_offset (out_offset not used).
    uint64_t submit(ringd_collective collective, size_t count, ringd_dtype dtype, ringd_op op, size_t in_offset,
                    size_t out_offset, int root = 0) {
        ringd_coll d{};
        d.struct_size = sizeof d;
        d.collective = collective;
        d.dtype = dtype;
        d.op = op;
        d.count = count;
        d.in_offset = in_offset;
        d.out_offset = out_offset;
        d.root = root;
        uint64_t t = 0;
        check(ringd_submit_coll(c_, &d, &t));
        return t;
    }
    uint64_t submit(size_t offset, size_t count, ringd_dtype dtype, ringd_op op) {
        uint64_t t = 0;
        check(ringd_submit(c_, offset, count, dtype, op, &t));
        return t;
    }
    void wait(uint64_t ticket, int timeout_ms = -1) { check(ringd_wait(c_, ticket, timeout_ms)); }
    // This client's wire for ops that name none (ringd_set_wire; docs/wire.md).
    void set_wire(ringd_wire wire) { check(ringd_set_wire(c_, wire)); }
    // Any collective with every field of ringd_coll (its wire, error feedback): struct_size is set here.
    uint64_t submit(ringd_coll d) {
        d.struct_size = sizeof d;
        uint64_t t = 0;
        check(ringd_submit_coll(c_, &d, &t));
        return t;
    }

    ringd_client *get() const { return c_; }

private:
    void check(int rc) const {
        if (rc != 0) throw ClientError(rc, ringd_last_error(c_));
    }
    ringd_client *c_ = nullptr;
};

}  // namespace ringd
