/* kvindex.indexer._payload: vLLM KV-event batches for the ingest hot path (indexer/decode.py), which reads
 * their token ids only for the sampled hash check. `read_events` (at the end) builds kvindex's events of a default-shape batch
 * itself; `without_token_ids` (first) copies any other batch it can without its token ids; `stored_token_ids`
 * reads the token ids of the one event the hash check samples, packed for the hash core.
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
/* read_events drops the GIL only for batches this large: a default batch (~6 KB) reads in ~3 us, and on a
 * 2-core box each drop hands the GIL to the subscriber thread, which the worker then waits to get back
 * (benchmarks.ingest, 100 x 10k, 3 runs each: 2.2-2.5M blocks/s dropping it from 1 KB, 2.5-3.0M not). */
#define READ_RELEASE_GIL_BYTES (256 * 1024)

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
            if (marker == 0xcc && need(r, 2)) {
                r->p += 2;
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

/* ---- read_events: the default batch shape read straight into kvindex's events -------------------------
 *
 * decode.py's hot path used to decode the slim copy with msgspec into vLLM-shaped structs and then build
 * kvindex's events from them in Python: two objects and a dozen Python calls per event. For a batch of
 * vLLM 0.33's default shape (map events tagged first; unsigned 64-bit hashes; no extra keys beyond nil
 * entries; no lookahead tokens; every string field nil or a str; every int field nil or an int),
 * `read_events` reads the bytes once (without the GIL for a very large batch) and then builds the events, exactly as
 * convert.stored_event / removed_event would. Anything else returns None and takes the msgspec path, which
 * also says what is wrong with a bad batch: this reader never raises on bad bytes, it only declines them.
 */

enum { INT_NIL = 0, INT_SIGNED = 1, INT_UNSIGNED = 2 };

typedef struct {
    uint8_t tag;
    uint64_t bits;
} IntValue;

typedef struct {
    const uint8_t *p; /* NULL: nil or absent */
    uint32_t len;
} StrValue;

enum { KIND_STORED, KIND_REMOVED, KIND_CLEARED };

typedef struct {
    uint8_t kind;
    size_t first_key, num_keys;
    IntValue parent, block_size, group_idx;
    StrValue medium, lora_name, spec_kind, locality, ownership, session_id;
    int64_t extra_len; /* -1: nil */
    const uint8_t *token_ids_at; /* where the token_ids value starts (skipped, read only by stored_token_ids) */
} EventFields;

typedef struct {
    uint64_t *keys;
    size_t num_keys, cap_keys;
    EventFields *events;
    size_t num_events;
    double ts;
    IntValue rank;
} Parsed;

static int
read_int(Reader *r, IntValue *out)
{
    if (!need(r, 1)) {
        return -1;
    }
    uint8_t marker = *r->p++;
    if (marker <= 0x7f) {
        out->tag = INT_UNSIGNED;
        out->bits = marker;
        return 0;
    }
    if (marker >= 0xe0) {
        out->tag = INT_SIGNED;
        out->bits = (uint64_t)(int64_t)(int8_t)marker;
        return 0;
    }
    int width;
    switch (marker) {
    case 0xcc: case 0xd0: width = 1; break;
    case 0xcd: case 0xd1: width = 2; break;
    case 0xce: case 0xd2: width = 4; break;
    case 0xcf: case 0xd3: width = 8; break;
    default: return -1;
    }
    if (!need(r, (size_t)width)) {
        return -1;
    }
    uint64_t bits = read_be(r->p, width);
    r->p += width;
    if (marker >= 0xd0) { /* int 8..64: sign-extend */
        int shift = 64 - 8 * width;
        out->tag = INT_SIGNED;
        out->bits = shift ? (uint64_t)(((int64_t)(bits << shift)) >> shift) : bits;
    }
    else {
        out->tag = INT_UNSIGNED;
        out->bits = bits;
    }
    return 0;
}

static int
read_int_or_nil(Reader *r, IntValue *out)
{
    if (need(r, 1) && *r->p == 0xc0) {
        r->p++;
        out->tag = INT_NIL;
        return 0;
    }
    return read_int(r, out);
}

/* A block hash: any msgpack int from 0 to 2**64 - 1 (vLLM's default form). */
static int
read_key(Reader *r, uint64_t *key)
{
    IntValue value;
    if (read_int(r, &value) < 0 || (value.tag == INT_SIGNED && (int64_t)value.bits < 0)) {
        return -1;
    }
    *key = value.bits;
    return 0;
}

static int
read_str_or_nil(Reader *r, StrValue *out)
{
    if (!need(r, 1)) {
        return -1;
    }
    uint8_t marker = *r->p++;
    uint64_t length;
    if (marker == 0xc0) {
        out->p = NULL;
        out->len = 0;
        return 0;
    }
    if ((marker & 0xe0) == 0xa0) {
        length = marker & 0x1f;
    }
    else if (marker == 0xd9 || marker == 0xda || marker == 0xdb) {
        if (read_length(r, marker == 0xd9 ? 1 : marker == 0xda ? 2 : 4, &length) < 0) {
            return -1;
        }
    }
    else {
        return -1;
    }
    if (!need(r, length)) {
        return -1;
    }
    out->p = r->p;
    out->len = (uint32_t)length;
    r->p += length;
    return 0;
}

/* An array header only (fixarray, array 16/32); its length is checked against the bytes left. */
static int
read_array(Reader *r, uint64_t *count)
{
    int is_map;
    if (read_container(r, &is_map, count) < 0 || is_map || *count > (uint64_t)(r->end - r->p)) {
        return -1;
    }
    return 0;
}

enum {
    F_BLOCK_HASHES, F_PARENT, F_TOKEN_IDS, F_BLOCK_SIZE, F_LORA_ID, F_MEDIUM, F_LORA_NAME, F_EXTRA_KEYS,
    F_GROUP_IDX, F_SPEC_KIND, F_SLIDING_WINDOW, F_LOCALITY, F_OWNERSHIP, F_SESSION_ID, F_LOOKAHEAD,
    NUM_FIELDS
};

/* vLLM 0.33's field names (replay/wire.py), in enum order. */
static const char *const FIELD_NAMES[NUM_FIELDS] = {
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
    "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality",
    "ownership", "session_id", "lookahead_token_ids",
};

#define BIT(f) (1u << (f))
/* The fields without defaults, and every field, of each tagged struct (wire.BlockStored, BlockRemoved). */
static const uint32_t STORED_REQUIRED = BIT(F_BLOCK_HASHES) | BIT(F_PARENT) | BIT(F_TOKEN_IDS)
                                        | BIT(F_BLOCK_SIZE) | BIT(F_LORA_ID) | BIT(F_MEDIUM)
                                        | BIT(F_LORA_NAME);
static const uint32_t STORED_FIELDS = (1u << NUM_FIELDS) - 1;
static const uint32_t REMOVED_REQUIRED = BIT(F_BLOCK_HASHES) | BIT(F_MEDIUM);
static const uint32_t REMOVED_FIELDS = BIT(F_BLOCK_HASHES) | BIT(F_MEDIUM) | BIT(F_GROUP_IDX)
                                       | BIT(F_LOCALITY) | BIT(F_OWNERSHIP);

/* Whether the bytes at p are `name` (a string literal: its length is known when inlined). */
static inline int
span_is(const uint8_t *p, uint64_t len, const char *name)
{
    size_t n = strlen(name);
    return len == n && memcmp(p, name, n) == 0;
}

static size_t FIELD_LENGTHS[NUM_FIELDS];

/* A map key: a fixstr naming one of the fields; -1 for anything else (an unknown field declines). */
static int
read_field(Reader *r)
{
    if (!need(r, 1) || (*r->p & 0xe0) != 0xa0) {
        return -1;
    }
    uint64_t len = *r->p & 0x1f;
    r->p++;
    if (!need(r, len)) {
        return -1;
    }
    const uint8_t *name = r->p;
    r->p += len;
    for (int f = 0; f < NUM_FIELDS; f++) {
        if (len == FIELD_LENGTHS[f] && memcmp(name, FIELD_NAMES[f], len) == 0) {
            return f;
        }
    }
    return -1;
}

static int
push_key(Parsed *out, uint64_t key)
{
    if (out->num_keys == out->cap_keys) {
        size_t cap = out->cap_keys ? 2 * out->cap_keys : 256;
        uint64_t *grown = realloc(out->keys, cap * sizeof(uint64_t));
        if (grown == NULL) {
            return -1;
        }
        out->keys = grown;
        out->cap_keys = cap;
    }
    out->keys[out->num_keys++] = key;
    return 0;
}

static int
read_event(Reader *r, Parsed *out, EventFields *ev)
{
    int is_map;
    uint64_t count;
    StrValue tag;
    if (read_container(r, &is_map, &count) < 0 || !is_map || count < 1) {
        return -1;
    }
    if (!need(r, 5) || memcmp(r->p, "\xa4type", 5) != 0) {
        return -1;
    }
    r->p += 5;
    if (read_str_or_nil(r, &tag) < 0 || tag.p == NULL) {
        return -1;
    }
    uint32_t required, allowed;
    memset(ev, 0, sizeof(*ev));
    ev->extra_len = -1;
    ev->first_key = out->num_keys;
    if (span_is(tag.p, tag.len, "BlockStored")) {
        ev->kind = KIND_STORED;
        required = STORED_REQUIRED;
        allowed = STORED_FIELDS;
    }
    else if (span_is(tag.p, tag.len, "BlockRemoved")) {
        ev->kind = KIND_REMOVED;
        required = REMOVED_REQUIRED;
        allowed = REMOVED_FIELDS;
    }
    else if (span_is(tag.p, tag.len, "AllBlocksCleared")) {
        ev->kind = KIND_CLEARED;
        required = allowed = 0;
    }
    else {
        return -1;
    }
    uint32_t seen = 0;
    for (uint64_t i = 1; i < count; i++) {
        int field = read_field(r);
        if (field < 0 || !(allowed & BIT(field)) || (seen & BIT(field))) {
            return -1;
        }
        seen |= BIT(field);
        uint64_t n;
        IntValue ignored;
        int status = 0;
        switch (field) {
        case F_BLOCK_HASHES:
            if (read_array(r, &n) < 0) {
                return -1;
            }
            for (uint64_t k = 0; k < n; k++) {
                uint64_t key;
                if (read_key(r, &key) < 0 || push_key(out, key) < 0) {
                    return -1;
                }
            }
            ev->num_keys = (size_t)n;
            break;
        case F_PARENT:
            if (need(r, 1) && *r->p == 0xc0) {
                r->p++;
                ev->parent.tag = INT_NIL;
            }
            else {
                status = read_key(r, &ev->parent.bits);
                ev->parent.tag = INT_UNSIGNED;
            }
            break;
        case F_TOKEN_IDS:
            ev->token_ids_at = r->p;
            status = skip(r, 2);
            break;
        case F_BLOCK_SIZE: status = read_int(r, &ev->block_size); break;
        case F_LORA_ID: status = read_int_or_nil(r, &ignored); break;
        case F_SLIDING_WINDOW: status = read_int_or_nil(r, &ignored); break;
        case F_GROUP_IDX: status = read_int_or_nil(r, &ev->group_idx); break;
        case F_MEDIUM: status = read_str_or_nil(r, &ev->medium); break;
        case F_LORA_NAME: status = read_str_or_nil(r, &ev->lora_name); break;
        case F_SPEC_KIND: status = read_str_or_nil(r, &ev->spec_kind); break;
        case F_LOCALITY: status = read_str_or_nil(r, &ev->locality); break;
        case F_OWNERSHIP: status = read_str_or_nil(r, &ev->ownership); break;
        case F_SESSION_ID: status = read_str_or_nil(r, &ev->session_id); break;
        case F_EXTRA_KEYS:
            if (need(r, 1) && *r->p == 0xc0) {
                r->p++;
                break;
            }
            if (read_array(r, &n) < 0) {
                return -1;
            }
            for (uint64_t k = 0; k < n; k++) { /* a plain block's entry: nil, or an empty array */
                if (!need(r, 1) || (*r->p != 0xc0 && *r->p != 0x90)) {
                    return -1;
                }
                r->p++;
            }
            ev->extra_len = (int64_t)n;
            break;
        case F_LOOKAHEAD:
            if (!need(r, 1) || *r->p != 0xc0) {
                return -1;
            }
            r->p++;
            break;
        }
        if (status < 0) {
            return -1;
        }
    }
    return (seen & required) == required ? 0 : -1;
}

static int
read_batch(Reader *r, Parsed *out)
{
    int is_map;
    uint64_t count, num_events;
    if (read_container(r, &is_map, &count) < 0 || is_map || count < 2 || count > 3 || !need(r, 1)) {
        return -1;
    }
    uint8_t marker = *r->p++;
    if (marker == 0xcb && need(r, 8)) {
        uint64_t bits = read_be(r->p, 8);
        memcpy(&out->ts, &bits, 8);
        r->p += 8;
    }
    else if (marker == 0xca && need(r, 4)) {
        uint32_t bits = (uint32_t)read_be(r->p, 4);
        float value;
        memcpy(&value, &bits, 4);
        out->ts = value;
        r->p += 4;
    }
    else {
        return -1;
    }
    if (read_array(r, &num_events) < 0) {
        return -1;
    }
    out->events = malloc((num_events ? num_events : 1) * sizeof(EventFields));
    if (out->events == NULL) {
        return -1;
    }
    for (uint64_t i = 0; i < num_events; i++) {
        if (read_event(r, out, &out->events[i]) < 0) {
            return -1;
        }
        out->num_events++;
    }
    out->rank.tag = INT_NIL;
    if (count == 3 && read_int_or_nil(r, &out->rank) < 0) {
        return -1;
    }
    return r->p == r->end ? 0 : -1;
}

static PyObject *SPEC_FULL_ATTENTION; /* "full_attention", shared by every event that names it */

static PyObject *
int_object(IntValue value)
{
    if (value.tag == INT_NIL) {
        Py_RETURN_NONE;
    }
    return value.tag == INT_SIGNED ? PyLong_FromLongLong((int64_t)value.bits)
                                   : PyLong_FromUnsignedLongLong(value.bits);
}

/* A str field's value (None when nil); NULL with an error set when its bytes are not UTF-8. */
static PyObject *
str_object(StrValue value)
{
    if (value.p == NULL) {
        Py_RETURN_NONE;
    }
    if (span_is(value.p, value.len, "full_attention")) {
        Py_INCREF(SPEC_FULL_ATTENTION);
        return SPEC_FULL_ATTENTION;
    }
    return PyUnicode_DecodeUTF8((const char *)value.p, value.len, NULL);
}

/* The tier of a medium: convert's `medium or TIER_GPU`. */
static PyObject *
tier_object(StrValue medium, PyObject *gpu_tier)
{
    if (medium.p == NULL || medium.len == 0 || span_is(medium.p, medium.len, "GPU")) {
        Py_INCREF(gpu_tier);
        return gpu_tier;
    }
    return PyUnicode_DecodeUTF8((const char *)medium.p, medium.len, NULL);
}

/* A str that is only checked (vLLM's ownership and session id: msgspec refuses them when not UTF-8). */
static int
check_str(StrValue value)
{
    if (value.p == NULL) {
        return 0;
    }
    PyObject *text = PyUnicode_DecodeUTF8((const char *)value.p, value.len, NULL);
    if (text == NULL) {
        return -1;
    }
    Py_DECREF(text);
    return 0;
}

static PyObject *
keys_tuple(const Parsed *parsed, const EventFields *ev)
{
    PyObject *keys = PyTuple_New((Py_ssize_t)ev->num_keys);
    if (keys == NULL) {
        return NULL;
    }
    for (size_t k = 0; k < ev->num_keys; k++) {
        PyObject *key = PyLong_FromUnsignedLongLong(parsed->keys[ev->first_key + k]);
        if (key == NULL) {
            Py_DECREF(keys);
            return NULL;
        }
        PyTuple_SET_ITEM(keys, (Py_ssize_t)k, key);
    }
    PyObject_GC_UnTrack(keys); /* ints only: never part of a cycle, and the collector need not visit it */
    return keys;
}

/* One event object; NULL with an error set (a string that is not UTF-8, or no memory). */
static PyObject *
event_object(const Parsed *parsed, const EventFields *ev, PyObject *const *types)
{
    PyObject *stored_type = types[0], *removed_type = types[1], *cleared = types[2], *gpu_tier = types[3];
    if (ev->kind == KIND_CLEARED) {
        Py_INCREF(cleared);
        return cleared;
    }
    PyObject *args[11] = {NULL};
    PyObject *result = NULL;
    int nargs;
    if (check_str(ev->ownership) < 0 || check_str(ev->session_id) < 0) {
        return NULL;
    }
    if ((args[0] = keys_tuple(parsed, ev)) == NULL) {
        goto done;
    }
    if (ev->kind == KIND_REMOVED) {
        /* BlocksRemoved(block_keys, tier, group_idx) */
        nargs = 3;
        if ((args[1] = tier_object(ev->medium, gpu_tier)) == NULL || (args[2] = int_object(ev->group_idx)) == NULL) {
            goto done;
        }
        result = PyObject_Vectorcall(removed_type, args, 3, NULL);
        goto done;
    }
    /* BlocksStored(block_keys, parent_key, token_ids, block_size, tier, lora_name, extra_keys, group_idx,
     * spec_kind, locality, lookahead_token_ids): stored_event's positional order. */
    nargs = 11;
    if ((args[1] = int_object(ev->parent)) == NULL || (args[2] = PyTuple_New(0)) == NULL
        || (args[3] = int_object(ev->block_size)) == NULL || (args[4] = tier_object(ev->medium, gpu_tier)) == NULL
        || (args[5] = str_object(ev->lora_name)) == NULL) {
        goto done;
    }
    if (ev->extra_len < 0) {
        Py_INCREF(Py_None);
        args[6] = Py_None;
    }
    else {
        if ((args[6] = PyTuple_New((Py_ssize_t)ev->extra_len)) == NULL) {
            goto done;
        }
        for (int64_t k = 0; k < ev->extra_len; k++) {
            Py_INCREF(Py_None);
            PyTuple_SET_ITEM(args[6], (Py_ssize_t)k, Py_None);
        }
        PyObject_GC_UnTrack(args[6]);
    }
    if ((args[7] = int_object(ev->group_idx)) == NULL || (args[8] = str_object(ev->spec_kind)) == NULL
        || (args[9] = str_object(ev->locality)) == NULL) {
        goto done;
    }
    Py_INCREF(Py_None);
    args[10] = Py_None;
    result = PyObject_Vectorcall(stored_type, args, 11, NULL);
done:
    for (int i = 0; i < 11; i++) {
        Py_XDECREF(args[i]);
    }
    (void)nargs;
    return result;
}

static PyObject *
build_batch(const Parsed *parsed, PyObject *const *types)
{
    PyObject *events = PyTuple_New((Py_ssize_t)parsed->num_events);
    if (events == NULL) {
        return NULL;
    }
    for (size_t i = 0; i < parsed->num_events; i++) {
        PyObject *event = event_object(parsed, &parsed->events[i], types);
        if (event == NULL) {
            Py_DECREF(events);
            return NULL;
        }
        PyTuple_SET_ITEM(events, (Py_ssize_t)i, event);
    }
    /* The events are untracked structs (indexer/events.py) of immutable values: no cycle can go through. */
    PyObject_GC_UnTrack(events);
    PyObject *ts = PyFloat_FromDouble(parsed->ts);
    PyObject *rank = int_object(parsed->rank);
    if (ts == NULL || rank == NULL) {
        Py_XDECREF(ts);
        Py_XDECREF(rank);
        Py_DECREF(events);
        return NULL;
    }
    PyObject *result = PyTuple_Pack(3, ts, events, rank);
    Py_DECREF(ts);
    Py_DECREF(events);
    Py_DECREF(rank);
    return result;
}

/* A worker's drain is read at once: every batch's bytes walked in one stretch without the GIL (once there
 * is enough to walk: ~6 KB a batch, 64 batches a drain), so the subscriber's Python work goes on on the
 * other core meanwhile; then each one's events built. */
#define READ_MANY_RELEASE_GIL_BYTES (64 * 1024)

typedef struct {
    const uint8_t *data;
    Py_ssize_t size;
    Parsed parsed;
    int status;
} PayloadRead;

/* Each payload of the list read: the list of (ts, events, rank), None where one is not of the default shape
 * (or not UTF-8 where a str must be); NULL with an exception. The bytes are walked without the GIL once
 * they add up to `release_bytes`. */
static PyObject *
read_payloads(PyObject *payloads, PyObject *const *types, size_t release_bytes)
{
    Py_ssize_t n = PyList_GET_SIZE(payloads);
    PayloadRead *reads = calloc(n ? (size_t)n : 1, sizeof(PayloadRead));
    PyObject *result = NULL;
    if (reads == NULL) {
        return PyErr_NoMemory();
    }
    size_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *payload = PyList_GET_ITEM(payloads, i);
        if (!PyBytes_Check(payload)) {
            PyErr_SetString(PyExc_TypeError, "every payload must be bytes");
            goto done;
        }
        reads[i].data = (const uint8_t *)PyBytes_AS_STRING(payload);
        reads[i].size = PyBytes_GET_SIZE(payload);
        total += (size_t)reads[i].size;
    }
    /* The payloads are immutable and held by the list, which the caller keeps alive and unchanged. */
    if (total >= release_bytes) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            Reader reader = {reads[i].data, reads[i].data + reads[i].size};
            reads[i].status = read_batch(&reader, &reads[i].parsed);
        }
        Py_END_ALLOW_THREADS
    }
    else {
        for (Py_ssize_t i = 0; i < n; i++) {
            Reader reader = {reads[i].data, reads[i].data + reads[i].size};
            reads[i].status = read_batch(&reader, &reads[i].parsed);
        }
    }
    result = PyList_New(n);
    if (result == NULL) {
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *read = NULL;
        if (reads[i].status == 0) {
            read = build_batch(&reads[i].parsed, types);
            if (read == NULL) {
                if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
                    Py_CLEAR(result);
                    goto done;
                }
                PyErr_Clear(); /* a str that is not UTF-8: msgspec's path says so */
            }
        }
        PyList_SET_ITEM(result, i, read != NULL ? read : Py_NewRef(Py_None));
    }
done:
    for (Py_ssize_t i = 0; i < n; i++) {
        free(reads[i].parsed.keys);
        free(reads[i].parsed.events);
    }
    free(reads);
    return result;
}

static PyObject *
read_events(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5 || !PyBytes_Check(args[0]) || !PyUnicode_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError,
                        "read_events(payload: bytes, stored_type, removed_type, cleared, gpu_tier: str)");
        return NULL;
    }
    PyObject *payloads = PyList_New(1);
    if (payloads == NULL) {
        return NULL;
    }
    PyList_SET_ITEM(payloads, 0, Py_NewRef(args[0]));
    PyObject *reads = read_payloads(payloads, args + 1, READ_RELEASE_GIL_BYTES);
    Py_DECREF(payloads);
    if (reads == NULL) {
        return NULL;
    }
    PyObject *read = Py_NewRef(PyList_GET_ITEM(reads, 0));
    Py_DECREF(reads);
    return read;
}

static PyObject *
read_events_many(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5 || !PyList_CheckExact(args[0]) || !PyUnicode_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError,
                        "read_events_many(payloads: list[bytes], stored_type, removed_type, cleared, gpu_tier: str)");
        return NULL;
    }
    return read_payloads(args[0], args + 1, READ_MANY_RELEASE_GIL_BYTES);
}

/* The arguments (payload: bytes, pos: int) of event_span and stored_token_ids: `r` over the payload, moved to
 * its event `pos` ([ts, [event, ...], rank?]). 1 when it is there; 0 when there is no such event (another
 * outline, too few events, bad bytes: the caller answers None); -1 with a TypeError for other arguments. */
static int
at_event(PyObject *const *args, Py_ssize_t nargs, const char *signature, Reader *r)
{
    if (nargs != 2 || !PyBytes_Check(args[0]) || !PyLong_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, signature);
        return -1;
    }
    Py_ssize_t pos = PyLong_AsSsize_t(args[1]);
    if (pos == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    r->p = (const uint8_t *)PyBytes_AS_STRING(args[0]);
    r->end = r->p + PyBytes_GET_SIZE(args[0]);
    int is_map;
    uint64_t count, num_events;
    if (pos < 0 || read_container(r, &is_map, &count) < 0 || is_map || count < 2 || count > 3 || skip(r, 1) < 0 ||
        read_container(r, &is_map, &num_events) < 0 || is_map || (uint64_t)pos >= num_events ||
        skip_items(r, (uint64_t)pos, 2) < 0) {
        return 0;
    }
    return 1;
}

/* Where event `pos` of an array-shaped batch lies in its bytes, for the hash check, which decodes that one
 * event again with its token ids: msgspec splitting the whole batch into raw events to reach it was ~4% of
 * ingest with 1,000 pods (each pod's first chain heads are checked). */
static PyObject *
event_span(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    Reader r;
    int found = at_event(args, nargs, "event_span(payload: bytes, pos: int)", &r);
    if (found <= 0) {
        return found < 0 ? NULL : Py_NewRef(Py_None);
    }
    const uint8_t *data = (const uint8_t *)PyBytes_AS_STRING(args[0]);
    const uint8_t *start = r.p;
    if (skip(&r, 2) < 0) {
        Py_RETURN_NONE;
    }
    return Py_BuildValue("(nn)", (Py_ssize_t)(start - data), (Py_ssize_t)(r.p - data));
}

/* The hash check's second reading of event `pos`, for a BlockStored of vLLM's default shape: (its token ids
 * packed as native uint32, i.e. array('I') bytes; its block keys packed as native uint64, array('Q') bytes),
 * so the compiled hash core takes the ids as they are. None for any other event or outline, and when an id
 * does not fit in 32 bits: the caller then decodes the event with msgspec, as before. With 1,000 pods (two
 * checks per pod, all in its first batches) that decode was a fifth of the worker's time, most of it
 * building an int object per token id. */
static PyObject *
stored_token_ids(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    Reader r;
    int found = at_event(args, nargs, "stored_token_ids(payload: bytes, pos: int)", &r);
    if (found <= 0) {
        return found < 0 ? NULL : Py_NewRef(Py_None);
    }
    Parsed parsed;
    EventFields ev;
    memset(&parsed, 0, sizeof(parsed));
    PyObject *result = NULL;
    if (read_event(&r, &parsed, &ev) < 0 || ev.kind != KIND_STORED || ev.token_ids_at == NULL) {
        goto declined;
    }
    Reader ids = {ev.token_ids_at, r.p};
    uint64_t num_ids;
    if (read_array(&ids, &num_ids) < 0) {
        goto declined;
    }
    PyObject *packed_ids = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(num_ids * sizeof(uint32_t)));
    if (packed_ids == NULL) {
        free(parsed.keys);
        return NULL;
    }
    char *out = PyBytes_AS_STRING(packed_ids);
    for (uint64_t k = 0; k < num_ids; k++) {
        IntValue value;
        if (read_int(&ids, &value) < 0 || (value.tag == INT_SIGNED && (int64_t)value.bits < 0) ||
            value.bits > UINT32_MAX) {
            Py_DECREF(packed_ids);
            goto declined;
        }
        uint32_t id = (uint32_t)value.bits;
        memcpy(out + k * sizeof(uint32_t), &id, sizeof(uint32_t));
    }
    PyObject *packed_keys = PyBytes_FromStringAndSize(
        (const char *)(parsed.keys + ev.first_key), (Py_ssize_t)(ev.num_keys * sizeof(uint64_t)));
    if (packed_keys != NULL) {
        result = PyTuple_Pack(2, packed_ids, packed_keys);
        Py_DECREF(packed_keys);
    }
    Py_DECREF(packed_ids);
    free(parsed.keys);
    return result;
declined:
    free(parsed.keys);
    Py_RETURN_NONE;
}

static PyMethodDef payload_methods[] = {
    {"without_token_ids", (PyCFunction)(void (*)(void))without_token_ids, METH_FASTCALL,
     "without_token_ids(payload: bytes, min_bytes: int = 1024) -> bytes | None: the batch with each map "
     "event's token_ids an empty array, or None (not the expected outline, nothing to take out, or "
     "shorter than min_bytes)."},
    {"read_events", (PyCFunction)(void (*)(void))read_events, METH_FASTCALL,
     "read_events(payload: bytes, stored_type, removed_type, cleared, gpu_tier: str) -> "
     "tuple[float, tuple[event, ...], int | None] | None: a batch of vLLM's default shape read into events "
     "(stored_type(...) and removed_type(...) built as convert.stored_event / removed_event would), or None "
     "for any other shape or bad bytes."},
    {"read_events_many", (PyCFunction)(void (*)(void))read_events_many, METH_FASTCALL,
     "read_events_many(payloads: list[bytes], stored_type, removed_type, cleared, gpu_tier: str) -> "
     "list[tuple | None]: read_events of each payload, their bytes walked in one stretch without the GIL."},
    {"event_span", (PyCFunction)(void (*)(void))event_span, METH_FASTCALL,
     "event_span(payload: bytes, pos: int) -> tuple[int, int] | None: the byte span of event `pos` of a batch "
     "[ts, [event, ...], rank?], or None (another outline, too few events, bad bytes)."},
    {"stored_token_ids", (PyCFunction)(void (*)(void))stored_token_ids, METH_FASTCALL,
     "stored_token_ids(payload: bytes, pos: int) -> tuple[bytes, bytes] | None: event `pos` of a default-shape "
     "batch, a BlockStored, as (its token ids as array('I') bytes, its block keys as array('Q') bytes), or None "
     "(another event or outline, an id outside 32 bits, bad bytes)."},
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
    for (int f = 0; f < NUM_FIELDS; f++) {
        FIELD_LENGTHS[f] = strlen(FIELD_NAMES[f]);
    }
    SPEC_FULL_ATTENTION = PyUnicode_InternFromString("full_attention");
    if (SPEC_FULL_ATTENTION == NULL) {
        return NULL;
    }
    return PyModule_Create(&payload_module);
}
