#include "common/frame_reader.h"

#include <algorithm>

#include "common/fd_io.h"

namespace ringd {

Result<std::optional<Frame>> FrameReader::read(int fd, uint32_t max_payload) {
    for (;;) {
        // The header into its own buffer, then the payload straight into the frame's (sized
        // only once the header's length passed the cap).
        uint8_t *at;
        size_t want;
        if (!header_) {
            if (header_got_ == proto::kFrameHeaderBytes) {
                auto h = proto::decode_frame_header(header_buf_, max_payload);
                if (!h) return h.error();
                header_ = *h;
                payload_.resize(h->length);
                got_ = 0;
                continue;
            }
            at = header_buf_.data() + header_got_;
            want = proto::kFrameHeaderBytes - header_got_;
        } else {
            if (got_ == payload_.size()) {
                Frame f{header_->type, std::move(payload_)};
                header_.reset();
                header_got_ = 0;
                payload_ = {};
                return std::optional<Frame>(std::move(f));
            }
            at = payload_.data() + got_;
            want = payload_.size() - got_;
        }
        std::vector<UniqueFd> fds;
        const ssize_t n = recv_some(fd, at, want, fds);
        if (n == -EAGAIN || n == -EWOULDBLOCK) return std::optional<Frame>();
        if (n < 0) return make_error(static_cast<int>(n), "receive: " + errno_string(static_cast<int>(n)));
        if (!fds.empty()) return make_error(-EPROTO, "file descriptors were sent; ringd accepts none");
        if (n == 0) {
            if (idle()) return make_error(-ECONNRESET, "disconnected");
            return make_error(-ECONNRESET, "disconnected in the middle of a frame");
        }
        if (header_) got_ += static_cast<size_t>(n);
        else header_got_ += static_cast<size_t>(n);
    }
}

}  // namespace ringd
