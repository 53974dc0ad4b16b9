/* kvindex.indexer._payload: a vLLM KV-event batch with its events' token ids taken out, for the ingest hot
 * path (indexer/decode.py), which never reads them.
 *
 * Token ids are most of a batch's bytes (16 per block against one hash), and msgspec must still walk them
 * to skip them: that was the largest single cost of ingest, all of it under the GIL. `without_token_ids`
 * walks the msgpack bytes here instead, without the GIL (so the other core goes on with Python work), and
 * writes a copy in which each map event's "token_ids" value is an empty array. Everything else is copied
 * byte for byte, so the hot decoder reads exactly the same events from the copy as from the original.
 *
 * Anything that is not a batch of the expected outline ([ts, [event, ...]] or [ts, [event, ...], rank],
 * complete, no trailing bytes, nesting below MAX_DEPTH) returns None: the caller decodes the original as
 * before. There is no pure-Python counterpart: without the extension the original is decoded, which gives
 * the same events (tests/indexer/test_payload.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define MAX_DEPTH 64
/* Below this size (by default) the copy is not worth making, nor the GIL worth dropping. */
#define MIN_PAYLOAD_BYTES 1024

typedef struct {
    const uint8_t *p;
    const uint8_t *end;
} Reader;

static inline int
need(const Reader *r, size_t n)
{
    return (size_t)(r->end - r->p) >= n;
}

static inline uint64_t
read_be(const uint8_t *p, int n)
{
    uint64_t value = 0;
    for (int i = 0; i < n; i++) {
        value = (value << 8) | p[i];
    }
    return value;
}

/* The length field of a str, bin, array, map or ext header at r->p (after the marker byte). */
static int
read_length(Reader *r, int width, uint64_t *length)
{
    if (!need(r, (size_t)width)) {
        return -1;
    }
    *length = read_be(r->p, width);
    r->p += width;
    return 0;
}

static int skip(Reader *r, int depth);

static int
skip_items(Reader *r, uint64_t count, int depth)
{
    for (uint64_t i = 0; i < count; i++) {
        /* The common element of a token-id array: a small int, read inline. */
        if (need(r, 1)) {
            uint8_t marker = *r->p;
            if (marker <= 0x7f) {
                r->p += 1;
                continue;
            }
            if (marker == 0xcd && need(r, 3)) {
                r->p += 3;
                continue;
            }
            if (marker == 0xce && need(r, 5)) {
                r->p += 5;
                continue;
            }
        }
        if (skip(r, depth) < 0) {
            return -1;
        }
    }
    return 0;
}

static int
skip_bytes(Reader *r, uint64_t n)
{
    if (!need(r, n)) {
        return -1;
    }
    r->p += n;
    return 0;
}

/* Past one complete msgpack value; -1 if it is truncated, malformed or nested too deep. */
static int
skip(Reader *r, int depth)
{
    uint64_t length;
    if (depth > MAX_DEPTH || !need(r, 1)) {
        return -1;
    }
    uint8_t marker = *r->p++;
    if (marker <= 0x7f || marker >= 0xe0 || marker == 0xc0 || marker == 0xc2 || marker == 0xc3) {
        return 0;
    }
    if ((marker & 0xe0) == 0xa0) { /* fixstr */
        return skip_bytes(r, marker & 0x1f);
    }
    if ((marker & 0xf0) == 0x90) { /* fixarray */
        return skip_items(r, marker & 0x0f, depth + 1);
    }
    if ((marker & 0xf0) == 0x80) { /* fixmap */
        return skip_items(r, 2 * (uint64_t)(marker & 0x0f), depth + 1);
    }
    switch (marker) {
    case 0xc4: case 0xc5: case 0xc6: /* bin 8/16/32 */
    case 0xd9: case 0xda: case 0xdb: /* str 8/16/32 */
    {
        int width = (marker == 0xc4 || marker == 0xd9) ? 1 : (marker == 0xc5 || marker == 0xda) ? 2 : 4;
        return read_length(r, width, &length) < 0 ? -1 : skip_bytes(r, length);
    }
    case 0xc7: case 0xc8: case 0xc9: /* ext 8/16/32: length, type, data */
    {
        int width = marker == 0xc7 ? 1 : marker == 0xc8 ? 2 : 4;
        return read_length(r, width, &length) < 0 ? -1 : skip_bytes(r, length + 1);
    }
    case 0xca: return skip_bytes(r, 4);
    case 0xcb: return skip_bytes(r, 8);
    case 0xcc: case 0xd0: return skip_bytes(r, 1);
    case 0xcd: case 0xd1: return skip_bytes(r, 2);
    case 0xce: case 0xd2: return skip_bytes(r, 4);
    case 0xcf: case 0xd3: return skip_bytes(r, 8);
    case 0xd4: return skip_bytes(r, 2); /* fixext 1, 2, 4, 8, 16: type + data */
    case 0xd5: return skip_bytes(r, 3);
    case 0xd6: return skip_bytes(r, 5);
    case 0xd7: return skip_bytes(r, 9);
    case 0xd8: return skip_bytes(r, 17);
    case 0xdc: case 0xdd: /* array 16/32 */
        return read_length(r, marker == 0xdc ? 2 : 4, &length) < 0 ? -1 : skip_items(r, length, depth + 1);
    case 0xde: case 0xdf: /* map 16/32 */
        return read_length(r, marker == 0xde ? 2 : 4, &length) < 0 ? -1
                                                                   : skip_items(r, 2 * length, depth + 1);
    default: /* 0xc1: never used */
        return -1;
    }
}

/* An array or map header at r->p: its item count (pairs for a map); -1 if it is neither. */
static int
read_container(Reader *r, int *is_map, uint64_t *count)
{
    if (!need(r, 1)) {
        return -1;
    }
    uint8_t marker = *r->p++;
    *is_map = 0;
    if ((marker & 0xf0) == 0x90) {
        *count = marker & 0x0f;
        return 0;
    }
    if ((marker & 0xf0) == 0x80) {
        *is_map = 1;
        *count = marker & 0x0f;
        return 0;
    }
    if (marker == 0xdc || marker == 0xdd) {
        return read_length(r, marker == 0xdc ? 2 : 4, count);
    }
    if (marker == 0xde || marker == 0xdf) {
        *is_map = 1;
        return read_length(r, marker == 0xde ? 2 : 4, count);
    }
    return -1;
}

typedef struct {
    uint8_t *out;
    size_t len;
    int removed; /* token-id values replaced */
} Writer;

static inline void
copy_span(Writer *w, const uint8_t *from, const uint8_t *to)
{
    memcpy(w->out + w->len, from, (size_t)(to - from));
    w->len += (size_t)(to - from);
}

static const uint8_t TOKEN_IDS_KEY[] = {0xa9, 't', 'o', 'k', 'e', 'n', '_', 'i', 'd', 's'};

/* One event: a map has its "token_ids" value replaced by an empty array, anything else is copied. */
static int
slim_event(Reader *r, Writer *w)
{
    const uint8_t *start = r->p;
    int is_map;
    uint64_t count;
    if (read_container(r, &is_map, &count) < 0 || !is_map) {
        r->p = start;
        if (skip(r, 1) < 0) {
            return -1;
        }
        copy_span(w, start, r->p);
        return 0;
    }
    copy_span(w, start, r->p);
    for (uint64_t i = 0; i < count; i++) {
        const uint8_t *key = r->p;
        if (skip(r, 2) < 0) {
            return -1;
        }
        int is_tokens = (size_t)(r->p - key) == sizeof(TOKEN_IDS_KEY)
                        && memcmp(key, TOKEN_IDS_KEY, sizeof(TOKEN_IDS_KEY)) == 0;
        copy_span(w, key, r->p);
        const uint8_t *value = r->p;
        if (skip(r, 2) < 0) {
            return -1;
        }
        if (is_tokens) {
            w->out[w->len++] = 0x90;
            w->removed++;
        }
        else {
            copy_span(w, value, r->p);
        }
    }
    return 0;
}

/* The whole batch into w; -1 if it is not the expected outline. Runs without the GIL. */
static int
slim_batch(Reader *r, Writer *w)
{
    const uint8_t *start = r->p;
    int is_map;
    uint64_t count, num_events;
    if (read_container(r, &is_map, &count) < 0 || is_map || count < 2 || count > 3) {
        return -1;
    }
    const uint8_t *ts = r->p;
    if (skip(r, 1) < 0) {
        return -1;
    }
    const uint8_t *events = r->p;
    if (read_container(r, &is_map, &num_events) < 0 || is_map) {
        return -1;
    }
    copy_span(w, start, r->p); /* the batch header, ts and the events header */
    (void)ts;
    (void)events;
    for (uint64_t i = 0; i < num_events; i++) {
        if (slim_event(r, w) < 0) {
            return -1;
        }
    }
    if (count == 3) {
        const uint8_t *rank = r->p;
        if (skip(r, 1) < 0) {
            return -1;
        }
        copy_span(w, rank, r->p);
    }
    return r->p == r->end ? 0 : -1;
}

static PyObject *
without_token_ids(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t min_bytes = MIN_PAYLOAD_BYTES;
    if (nargs < 1 || nargs > 2 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "without_token_ids(payload: bytes, min_bytes: int = 1024)");
        return NULL;
    }
    if (nargs == 2 && (min_bytes = PyLong_AsSsize_t(args[1])) == -1 && PyErr_Occurred()) {
        return NULL;
    }
    PyObject *payload = args[0];
    Py_ssize_t size = PyBytes_GET_SIZE(payload);
    if (size < min_bytes || size == 0) {
        Py_RETURN_NONE;
    }
    /* The copy is never longer than the original: each replaced value is at least one byte. */
    PyObject *slim = PyBytes_FromStringAndSize(NULL, size);
    if (slim == NULL) {
        return NULL;
    }
    Reader reader = {(const uint8_t *)PyBytes_AS_STRING(payload), (const uint8_t *)PyBytes_AS_STRING(payload) + size};
    Writer writer = {(uint8_t *)PyBytes_AS_STRING(slim), 0, 0};
    int status;
    /* Both objects stay alive (the caller's reference and ours), `payload` is immutable and `slim` is
     * not yet shared: neither needs the GIL while it is read or written. */
    Py_BEGIN_ALLOW_THREADS
    status = slim_batch(&reader, &writer);
    Py_END_ALLOW_THREADS
    if (status < 0 || writer.removed == 0) {
        Py_DECREF(slim);
        Py_RETURN_NONE;
    }
    if (_PyBytes_Resize(&slim, (Py_ssize_t)writer.len) < 0) {
        return NULL;
    }
    return slim;
}

static PyMethodDef payload_methods[] = {
    {"without_token_ids", (PyCFunction)(void (*)(void))without_token_ids, METH_FASTCALL,
     "without_token_ids(payload: bytes, min_bytes: int = 1024) -> bytes | None: the batch with each map "
     "event's token_ids an empty array, or None (not the expected outline, nothing to take out, or "
     "shorter than min_bytes)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef payload_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvindex.indexer._payload",
    .m_doc = "vLLM KV-event batches without their token ids, for the ingest hot path.",
    .m_size = -1,
    .m_methods = payload_methods,
};

PyMODINIT_FUNC
PyInit__payload(void)
{
    return PyModule_Create(&payload_module);
}
