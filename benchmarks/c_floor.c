/* The measurement floor in C (benchmarks/floor.py CFloorServer): what the Python floor does, without
 * Python. One thread waits in epoll; each connection's requests are framed as any HTTP/1.1 server must
 * (the head up to its blank line, then Content-Length bytes of body, pipelined or split across reads)
 * and each complete one is answered with the same canned response as the Python floor's, unread.
 *
 * Usage: c_floor RESPONSE_FILE   (the whole HTTP response to write per request); prints
 * "listening on http://127.0.0.1:PORT" and serves until killed.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#define MAX_REQUEST (8 << 20) /* a request larger than this closes its connection */

struct connection {
    int fd;
    char *buffer;
    size_t length, capacity;
};

static char *response;
static size_t response_length;

static void drop(int epoll_fd, struct connection *c) {
    epoll_ctl(epoll_fd, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    free(c->buffer);
    free(c);
}

static int write_all(int fd, const char *data, size_t size) {
    while (size > 0) {
        ssize_t written = write(fd, data, size);
        if (written < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        data += written;
        size -= (size_t)written;
    }
    return 0;
}

/* The Content-Length of the head [head, end) (0 if it has none). */
static size_t content_length(const char *head, const char *end) {
    for (const char *p = head; p < end; p++) {
        if (*p == '\n' && end - p > 16 && strncasecmp(p + 1, "content-length:", 15) == 0)
            return (size_t)strtoull(p + 16, NULL, 10);
    }
    return 0;
}

/* Answer every complete request buffered on `c`; -1 if the connection must close. */
static int serve(struct connection *c) {
    for (;;) {
        char *end = memmem(c->buffer, c->length, "\r\n\r\n", 4);
        if (end == NULL) return c->length < MAX_REQUEST ? 0 : -1;
        size_t request = (size_t)(end - c->buffer) + 4 + content_length(c->buffer, end);
        if (request > MAX_REQUEST) return -1;
        if (c->length < request) {
            if (c->capacity < request) {
                char *grown = realloc(c->buffer, request);
                if (grown == NULL) return -1;
                c->buffer = grown;
                c->capacity = request;
            }
            return 0;
        }
        if (write_all(c->fd, response, response_length) < 0) return -1;
        memmove(c->buffer, c->buffer + request, c->length - request);
        c->length -= request;
    }
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: c_floor RESPONSE_FILE\n");
        return 2;
    }
    FILE *file = fopen(argv[1], "rb");
    if (file == NULL || fseek(file, 0, SEEK_END) != 0) {
        perror(argv[1]);
        return 1;
    }
    long size = ftell(file);
    rewind(file);
    response = malloc(size > 0 ? (size_t)size : 1);
    response_length = fread(response, 1, (size_t)size, file);
    fclose(file);

    int listener = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in address = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t address_length = sizeof address;
    if (listener < 0 || bind(listener, (struct sockaddr *)&address, sizeof address) < 0 ||
        listen(listener, 64) < 0 ||
        getsockname(listener, (struct sockaddr *)&address, &address_length) < 0) {
        perror("listen");
        return 1;
    }
    int epoll_fd = epoll_create1(0);
    struct epoll_event event = {.events = EPOLLIN, .data.ptr = NULL};
    epoll_ctl(epoll_fd, EPOLL_CTL_ADD, listener, &event);
    printf("listening on http://127.0.0.1:%d\n", ntohs(address.sin_port));
    fflush(stdout);

    struct epoll_event ready[16];
    for (;;) {
        int count = epoll_wait(epoll_fd, ready, 16, -1);
        if (count < 0 && errno != EINTR) return 1;
        for (int i = 0; i < count; i++) {
            struct connection *c = ready[i].data.ptr;
            if (c == NULL) {
                int fd = accept(listener, NULL, NULL);
                if (fd < 0) continue;
                int one = 1;
                setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                c = calloc(1, sizeof *c);
                c->fd = fd;
                c->capacity = 64 * 1024;
                c->buffer = malloc(c->capacity);
                struct epoll_event added = {.events = EPOLLIN, .data.ptr = c};
                epoll_ctl(epoll_fd, EPOLL_CTL_ADD, fd, &added);
                continue;
            }
            if (c->length == c->capacity) {
                size_t capacity = c->capacity * 2;
                char *grown = capacity <= MAX_REQUEST ? realloc(c->buffer, capacity) : NULL;
                if (grown == NULL) {
                    drop(epoll_fd, c);
                    continue;
                }
                c->buffer = grown;
                c->capacity = capacity;
            }
            ssize_t received = read(c->fd, c->buffer + c->length, c->capacity - c->length);
            if (received < 0 && errno == EINTR) continue;
            if (received <= 0) {
                drop(epoll_fd, c);
                continue;
            }
            c->length += (size_t)received;
            if (serve(c) < 0) drop(epoll_fd, c);
        }
    }
}
