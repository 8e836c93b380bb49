/* Sets TCP_NODELAY on every connection a process accepts, through LD_PRELOAD.
 *
 * scripts/bench runs sglang-router both as shipped and under this preload: sglang-router 0.3.2 does
 * not set TCP_NODELAY on the client connections it accepts, so on a kept-alive connection its first
 * streamed chunk after the response headers waits for the client's delayed ACK (~40 ms on Linux).
 * The preload isolates its routing from that socket setting (docs/benchmarks.md, issue 12). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

int accept4(int sockfd, struct sockaddr *addr, socklen_t *len, int flags) {
    static int (*real_accept4)(int, struct sockaddr *, socklen_t *, int);
    if (!real_accept4) {
        real_accept4 = (int (*)(int, struct sockaddr *, socklen_t *, int))dlsym(RTLD_NEXT, "accept4");
    }
    int fd = real_accept4(sockfd, addr, len, flags);
    if (fd >= 0) {
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    }
    return fd;
}
