#include "daemon/ipc/client_conn.h"

#include <cstring>

#include "common/fd_io.h"
#include "daemon/ipc/slot.h"

namespace ringd {

ClientConn::ClientConn(MemberId id, UniqueFd sock, ucred cred, Clock::time_point hello_deadline)
    : id_(id), sock_(std::move(sock)), cred_(cred), hello_deadline_(hello_deadline) {}

std::string ClientConn::describe() const {
    std::string s = "client " + std::to_string(id_) + " (pid " + std::to_string(cred_.pid) + " uid " +
                    std::to_string(cred_.uid) + ")";
    if (state_ == State::Joined) s += " group " + group_ + " local rank " + std::to_string(local_rank_);
    return s;
}

// A joined client may pass one fd with a frame (a VMM allocation with CudaRegister).
Result<std::optional<Frame>> ClientConn::read_frame() {
    return reader_.read(sock_.get(), proto::kMaxClientPayload, state_ == State::Joined ? 1 : 0);
}

void ClientConn::joined(std::shared_ptr<Slot> slot, UniqueFd doorbell, UniqueFd completion, std::string group,
                        uint32_t local_rank, std::shared_ptr<void> lease) {
    slot_ = std::move(slot);
    lease_ = std::move(lease);
    doorbell_ = std::move(doorbell);
    completion_ = std::move(completion);
    group_ = std::move(group);
    local_rank_ = local_rank;
    state_ = State::Joined;
}

Status ClientConn::take_submissions(std::vector<proto::SubmitDesc> &out) {
    auto &h = slot_->header();
    const uint64_t tail = h.sq_tail.value.load(std::memory_order_acquire);
    const uint64_t depth = slot_->geometry().sq_depth;
    if (tail - sq_head_ > depth)
        return make_error(-EPROTO, "submission queue tail " + std::to_string(tail) + " is invalid (head " +
                                       std::to_string(sq_head_) + ", depth " + std::to_string(depth) + ")");
    // Every descriptor taken gets exactly one completion: taken - completed are its ops in ringd.
    const uint64_t credits = slot_->geometry().cq_depth;
    for (; sq_head_ != tail && sq_head_ - cq_tail_ < credits; ++sq_head_) {
        proto::SubmitDesc d;
        std::memcpy(&d, &slot_->sq_entry(sq_head_), sizeof d);  // copied once; only the copy is used
        out.push_back(d);
    }
    held_ = sq_head_ != tail;
    h.sq_head.value.store(sq_head_, std::memory_order_release);
    return Ok{};
}

Status ClientConn::complete(uint64_t seq, int32_t status, std::string_view message) {
    auto &h = slot_->header();
    const uint64_t head = h.cq_head.value.load(std::memory_order_acquire);
    const uint64_t depth = slot_->geometry().cq_depth;
    if (cq_tail_ - head >= depth)
        return make_error(-EOVERFLOW, "completion queue overflow: the client does not consume completions (head " +
                                          std::to_string(head) + ", tail " + std::to_string(cq_tail_) + ")");
    proto::fill_completion(slot_->cq_entry(cq_tail_), seq, status, message);
    ++cq_tail_;
    h.cq_tail.value.store(cq_tail_, std::memory_order_release);
    const uint64_t one = 1;
    (void)!::write(completion_.get(), &one, sizeof one);
    return Ok{};
}

}  // namespace ringd
