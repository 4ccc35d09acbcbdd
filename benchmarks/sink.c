/* A C sink for the lm:// protocol (specs/lm-protocol.md): the ceiling for
 * benchmarks/server_throughput.py.
 *
 *     sink PORT VALUE_BYTES BUFFERS
 *
 * Thread per connection, blocking sockets, no storage: a PUT's payload is received
 * (MSG_WAITALL, one large recv) into the connection's preallocated buffer; a GET is
 * answered with one sendmsg of the 36-byte response header and VALUE_BYTES from one of
 * BUFFERS preallocated, pre-faulted values in turn (byte i of value b is (i + b) & 0xff);
 * EXIST and HEALTH get SUCCESS with no payload. Prints "ready" once listening.
 * Buffers are 2 MiB aligned and advised MADV_HUGEPAGE, as lmkv_server's arena is (with
 * transparent huge pages on "madvise", only advised memory gets them).
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

enum { REQUEST_SIZE = 186, RESPONSE_SIZE = 36, PUT = 1, GET = 2, EXIST = 3, HEALTH = 5 };

static size_t value_bytes;
static int num_buffers;
static char **values;
static int32_t get_reply[9];    /* code, length, fmt, dtype, shape0..3, location */
static int32_t empty_reply[9];
static atomic_uint turn;

static char *huge_buffer(size_t n) {  /* pre-faulted, on huge pages where the kernel can */
    void *p = NULL;
    if (posix_memalign(&p, 2u << 20, n))
        return NULL;
    madvise(p, n, MADV_HUGEPAGE);
    memset(p, 0, n);
    return p;
}

static int recv_all(int fd, char *buf, size_t n) {
    while (n) {
        ssize_t got = recv(fd, buf, n, MSG_WAITALL);
        if (got <= 0)
            return 0;
        buf += got;
        n -= (size_t)got;
    }
    return 1;
}

static int send_all(int fd, struct iovec *iov, int count) {
    struct msghdr msg = {.msg_iov = iov, .msg_iovlen = (size_t)count};
    while (count) {
        ssize_t sent = sendmsg(fd, &msg, MSG_NOSIGNAL);
        if (sent <= 0)
            return 0;
        while (count && (size_t)sent >= iov->iov_len) {  /* drop the iovecs sent whole */
            sent -= (ssize_t)iov->iov_len;
            iov++;
            count--;
        }
        if (count) {
            iov->iov_base = (char *)iov->iov_base + sent;
            iov->iov_len -= (size_t)sent;
        }
        msg.msg_iov = iov;
        msg.msg_iovlen = (size_t)count;
    }
    return 1;
}

static void *serve(void *arg) {
    int fd = (int)(intptr_t)arg;
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    size_t cap = value_bytes;
    char *scratch = huge_buffer(cap);
    char header[REQUEST_SIZE];
    while (scratch && recv_all(fd, header, REQUEST_SIZE)) {
        int32_t command, length;
        memcpy(&command, header, 4);  /* little-endian int32 fields 0 and 1 */
        memcpy(&length, header + 4, 4);
        if (command == PUT) {
            if (length < 0)
                break;
            if ((size_t)length > cap) {
                free(scratch);
                cap = (size_t)length;
                scratch = huge_buffer(cap);
                if (!scratch)
                    break;
            }
            if (!recv_all(fd, scratch, (size_t)length))
                break;
        } else if (command == GET) {
            unsigned b = atomic_fetch_add(&turn, 1) % (unsigned)num_buffers;
            struct iovec iov[2] = {{get_reply, RESPONSE_SIZE}, {values[b], value_bytes}};
            if (!send_all(fd, iov, 2))
                break;
        } else if (command == EXIST || command == HEALTH) {
            struct iovec iov[1] = {{empty_reply, RESPONSE_SIZE}};
            if (!send_all(fd, iov, 1))
                break;
        }
    }
    free(scratch);
    close(fd);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s PORT VALUE_BYTES BUFFERS\n", argv[0]);
        return 2;
    }
    int port = atoi(argv[1]);
    value_bytes = (size_t)atoll(argv[2]);
    num_buffers = atoi(argv[3]);
    if (port <= 0 || value_bytes == 0 || value_bytes > INT32_MAX || num_buffers <= 0) {
        fprintf(stderr, "bad arguments\n");
        return 2;
    }
    values = calloc((size_t)num_buffers, sizeof *values);
    for (int b = 0; b < num_buffers; b++) {
        values[b] = huge_buffer(value_bytes);
        if (!values[b])
            return 1;
        for (size_t i = 0; i < value_bytes; i++)
            values[b][i] = (char)((i + (size_t)b) & 0xff);
    }
    /* GET hit: 200, length, fmt 4 (BINARY), dtype 6 (uint8), shape [length, 0, 0, 0], 0 */
    int32_t get[9] = {200, (int32_t)value_bytes, 4, 6, (int32_t)value_bytes, 0, 0, 0, 0};
    int32_t empty[9] = {200, 0, 1, 2, 0, 0, 0, 0, 0};
    memcpy(get_reply, get, sizeof get);
    memcpy(empty_reply, empty, sizeof empty);

    int listener = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(listener, (struct sockaddr *)&addr, sizeof addr) || listen(listener, 256)) {
        perror("sink: listen");
        return 1;
    }
    printf("ready\n");
    fflush(stdout);
    for (;;) {
        int fd = accept(listener, NULL, NULL);
        if (fd < 0)
            continue;
        pthread_t thread;
        if (pthread_create(&thread, NULL, serve, (void *)(intptr_t)fd) == 0)
            pthread_detach(thread);
        else
            close(fd);
    }
}
