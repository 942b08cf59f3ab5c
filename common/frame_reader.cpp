#include "common/frame_reader.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "common/fd_io.h"

namespace ringd {

Result<std::optional<Frame>> FrameReader::read(int fd, uint32_t max_payload, size_t max_fds) {
    for (;;) {
        // Frames out of what is buffered: the header (checked against the cap before the payload
        // is sized), then the payload.
        if (!header_) {
            if (tail_ - head_ >= proto::kFrameHeaderBytes) {
                auto h = proto::decode_frame_header(std::span(buf_).subspan(head_, proto::kFrameHeaderBytes), max_payload);
                if (!h) return h.error();
                head_ += proto::kFrameHeaderBytes;
                header_ = *h;
                payload_.resize(h->length);
                got_ = 0;
            }
        }
        if (header_) {
            const size_t take = std::min(tail_ - head_, payload_.size() - got_);
            if (take > 0) std::memcpy(payload_.data() + got_, buf_.data() + head_, take);
            head_ += take;
            got_ += take;
            if (got_ == payload_.size()) {
                Frame f{header_->type, std::move(payload_), std::exchange(fds_, {}), header_->version};
                header_.reset();
                payload_ = {};
                return std::optional<Frame>(std::move(f));
            }
        }
        // More bytes are needed. A short read before means the socket was drained then: report
        // "nothing more for now" without another system call (the caller's poll comes back when
        // more arrives).
        if (drained_) {
            drained_ = false;
            return std::optional<Frame>();
        }
        if (head_ == tail_) head_ = tail_ = 0;
        uint8_t *at;
        size_t want;
        if (header_ && payload_.size() - got_ >= kBufferBytes) {
            at = payload_.data() + got_;  // a large payload: straight into the frame
            want = payload_.size() - got_;
        } else {
            if (buf_.empty()) buf_.resize(kBufferBytes);
            if (head_ > 0) {  // keep the partial header at the front
                std::memmove(buf_.data(), buf_.data() + head_, tail_ - head_);
                tail_ -= head_;
                head_ = 0;
            }
            at = buf_.data() + tail_;
            want = kBufferBytes - tail_;
        }
        std::vector<UniqueFd> fds;
        const ssize_t n = recv_some(fd, at, want, fds);
        if (n == -EAGAIN || n == -EWOULDBLOCK) return std::optional<Frame>();
        if (n < 0) return make_error(static_cast<int>(n), "receive: " + errno_string(static_cast<int>(n)));
        if (!fds.empty()) {
            if (max_fds == 0) return make_error(-EPROTO, "file descriptors were sent; ringd accepts none here");
            if (fds_.size() + fds.size() > max_fds)
                return make_error(-EPROTO, "more than " + std::to_string(max_fds) + " file descriptor(s) sent with a frame");
            for (auto &f : fds) fds_.push_back(std::move(f));
        }
        if (n == 0) {
            if (idle()) return make_error(-ECONNRESET, "disconnected");
            return make_error(-ECONNRESET, "disconnected in the middle of a frame");
        }
        drained_ = static_cast<size_t>(n) < want;
        if (at == buf_.data() + tail_) tail_ += static_cast<size_t>(n);
        else got_ += static_cast<size_t>(n);
    }
}

}  // namespace ringd
